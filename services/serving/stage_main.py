"""Start-up steps every stage service shares."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from services.runtime.checkpoint import LoadedStage, Stage, load_stage
from services.serving.config import StageConfig

log = logging.getLogger(__name__)


def load_and_prepare(config: StageConfig, stage: Stage) -> LoadedStage:
    import torch
    import transformers

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")
    log.info("loading %s from %s on %s (%s%s)", stage.value, config.checkpoint, config.device, config.dtype,
             ", random weights" if config.random_weights else "")
    return load_stage(config.checkpoint, stage, device=config.device, dtype=config.dtype,
                      random_weights=config.random_weights, seed=config.random_seed)


def write_port_file(path: str | None, port: int) -> None:
    """Write the bound port atomically (the launcher and tests read it for port 0)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def serve_stage(name: str, create_server, config, port_file: str | None) -> None:
    """Run a stage service until SIGTERM / SIGINT: build it, serve, drain, stop its engine loop.

    `create_server(config)` returns (ServerHandle, EngineLoop); `config.stage` is its StageConfig."""
    import asyncio

    from services.serving.grpc_server import serve_until_signal, setup_logging

    setup_logging(name)

    async def serve() -> None:
        handle, loop = await create_server(config)

        def stop() -> None:
            loop.stop()
            close = getattr(loop.engine, "close", None)  # the vLLM backend owns an engine process
            if close is not None:
                close()

        await serve_until_signal(handle, config.stage.grace_s,
                                 on_started=lambda: write_port_file(port_file, handle.port), on_stop=stop)

    asyncio.run(serve())
