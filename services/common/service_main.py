"""Start-up steps every stage service shares."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from services.common.checkpoint import LoadedStage, Stage, load_stage
from services.common.config import StageConfig

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
