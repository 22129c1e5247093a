"""Running a stage service until SIGTERM / SIGINT: build it, serve, drain, stop its engine loop."""

from __future__ import annotations

from services.base.engine import Engine
from services.serving.config import ServingConfig
from services.serving.engine_loop import EngineLoop
from services.serving.grpc_server import ServerHandle, build_server, run_process, serve_until_signal, write_port_file
from services.serving.metrics import StageMetrics


def start_stage(stage: str, engine: Engine, serving: ServingConfig, service: str,
                cache_slots: int | None = None) -> tuple[ServerHandle, EngineLoop]:
    """What every stage server is around its servicer: the stage's metrics (served on their own
    port), the engine loop started on its thread, the gRPC server (health included) whose open
    streams the loop's LoadReport counts. The caller adds its servicer to `handle.server`."""
    metrics = StageMetrics(stage)
    if cache_slots is not None:
        metrics.cache_capacity.set(cache_slots)
    metrics.serve(serving.metrics_port)
    loop = EngineLoop(engine, stage, metrics)
    loop.start()
    handle = build_server(serving.host, serving.port, (service,), serving.max_message_bytes,
                          tls=serving.tls, health_port=serving.health_port)
    loop.streams = handle.streams  # LoadReport.in_flight counts open streams
    return handle, loop


def serve_stage(name: str, create_server, config, port_file: str | None) -> None:
    """Run a stage service until SIGTERM / SIGINT: build it, serve, drain, stop its engine loop.
    `create_server(config)` returns (ServerHandle, EngineLoop); `config.serving` is its ServingConfig."""

    async def serve(config, port_file: str | None) -> None:
        handle, loop = await create_server(config)

        def stop() -> None:
            loop.stop()
            loop.engine.close()  # the vLLM backend owns an engine process; the others hold nothing outside

        await serve_until_signal(handle, config.serving.grace_s, drain_delay_s=config.serving.drain_delay_s,
                                 on_started=lambda: write_port_file(port_file, handle.port), on_stop=stop,
                                 light_load_cpus=config.serving.light_load_cpus)

    run_process(name, serve, config, port_file)
