"""Running a stage service until SIGTERM / SIGINT: build it, serve, drain, stop its engine loop."""

from __future__ import annotations

import asyncio

from services.serving.grpc_server import (
    serve_until_signal,
    setup_logging,
    write_port_file,
)
from services.serving.tracing import setup as setup_tracing


def serve_stage(name: str, create_server, config, port_file: str | None) -> None:
    """Run a stage service until SIGTERM / SIGINT: build it, serve, drain, stop its engine loop.
    `create_server(config)` returns (ServerHandle, EngineLoop); `config.serving` is its ServingConfig."""
    setup_logging(name, config.serving.tracing.log_format)
    setup_tracing(name, config.serving.tracing, config.serving.port)

    async def serve() -> None:
        handle, loop = await create_server(config)

        def stop() -> None:
            loop.stop()
            loop.engine.close()  # the vLLM backend owns an engine process; the others hold nothing outside

        await serve_until_signal(handle, config.serving.grace_s, drain_delay_s=config.serving.drain_delay_s,
                                 on_started=lambda: write_port_file(port_file, handle.port), on_stop=stop,
                                 light_load_cpus=config.serving.light_load_cpus)

    asyncio.run(serve())
