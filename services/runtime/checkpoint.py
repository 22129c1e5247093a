"""Per-stage checkpoint loading: only the thinker, only the talker, or only code2wav.

A Qwen3-Omni checkpoint folder holds one state dict with keys `thinker.*`, `talker.*` and
`code2wav.*` (one or several safetensors files). Each stage class is loaded with transformers'
own `from_pretrained` and the stage's key prefix as `base_model_prefix`: safetensors are read
lazily, so the other stages' tensors are skipped, never materialised. The same code serves the
tiny checkpoint and Qwen/Qwen3-Omni-30B-A3B-Instruct (sharded, with an index file).

`random_weights=True` reads config.json only and builds the stage on the device with seeded
random weights (services/runtime/full_size.py): the real model's shape without its weights.
"""

from __future__ import annotations

import enum
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import Qwen3OmniMoeConfig
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from services.runtime.errors import UserError
from services.runtime.full_size import build_random_stage
from services.runtime.settings import ModelConfig

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    THINKER = "thinker"
    TALKER = "talker"
    CODE2WAV = "code2wav"


def check_folder(folder: str | Path, need_weights: bool = True) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"checkpoint folder not found: {path}")
    if not (path / "config.json").is_file():
        raise UserError(f"not a Qwen3-Omni checkpoint (no config.json): {path}")
    try:
        data = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path / 'config.json'}: not valid JSON ({exc})") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type != "qwen3_omni_moe":
        raise UserError(f"{path}: model_type is {model_type!r}, expected 'qwen3_omni_moe'")
    if need_weights and not any(path.glob("*.safetensors")):
        raise UserError(f"{path}: no .safetensors weights (for random weights at this shape: --random-weights)")
    return path


def load_config(folder: str | Path, need_weights: bool = True):
    return Qwen3OmniMoeConfig.from_pretrained(check_folder(folder, need_weights))


def checkpoint_keys(folder: str | Path) -> list[str]:
    """Every tensor name in the checkpoint, read from the safetensors headers only."""
    keys: list[str] = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def _stage_classes():
    # NOTE: MoE experts are stored one per expert on disk and fused in memory. transformers
    # registers that conversion for the whole model and the thinker, not for the talker on its
    # own (its config has no model_type), so register the same mapping for the talker class.
    register_checkpoint_conversion_mapping(
        "Qwen3OmniMoeTalkerForConditionalGeneration",
        get_checkpoint_conversion_mapping("qwen3_omni_moe"),
        overwrite=True,
    )

    class Code2WavFromCheckpoint(qm.Qwen3OmniMoeCode2Wav):
        # The vocoder class has no prefix of its own; its keys live under `code2wav.`.
        base_model_prefix = "code2wav"

    return {
        Stage.THINKER: (qm.Qwen3OmniMoeThinkerForConditionalGeneration, "thinker_config"),
        Stage.TALKER: (qm.Qwen3OmniMoeTalkerForConditionalGeneration, "talker_config"),
        Stage.CODE2WAV: (Code2WavFromCheckpoint, "code2wav_config"),
    }


@dataclass(frozen=True)
class LoadedStage:
    stage: Stage
    model: object  # the torch module, in eval mode
    config: object  # the full Qwen3OmniMoeConfig


def load_stage(folder: str | Path, stage: Stage, device: str = "cpu", dtype: str = "float32",
               random_weights: bool = False, seed: int = 0) -> LoadedStage:
    """Load one stage's module on `device` in `dtype` without reading the other stages
    (or, with `random_weights`, build it there from config.json with seeded random weights)."""
    config = load_config(folder, need_weights=not random_weights)
    cls, sub_name = _stage_classes()[stage]
    sub_config = getattr(config, sub_name)
    if stage is Stage.TALKER and not hasattr(sub_config, "audio_config"):
        # transformers bug: the talker's multimodal rope reads its config's audio config
        # (docs/qwen3-omni.md, section "transformers quirks").
        sub_config.audio_config = config.thinker_config.audio_config
    if random_weights:
        model = build_random_stage(cls, sub_config, stage.value, device, getattr(torch, dtype), seed)
        return LoadedStage(stage=stage, model=model, config=config)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists every other stage's key
    try:
        model, info = cls.from_pretrained(
            str(folder), config=sub_config, dtype=getattr(torch, dtype), output_loading_info=True,
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])[:5]
        raise UserError(f"{folder}: {stage.value} weights missing from the checkpoint: {missing}")
    model.to(device).eval()
    return LoadedStage(stage=stage, model=model, config=config)


def load_for_serving(config: ModelConfig, stage: Stage) -> LoadedStage:
    """A stage's module as a service loads it: torch threads set, transformers' logging quiet."""
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")
    log.info("loading %s from %s on %s (%s%s)", stage.value, config.checkpoint, config.device, config.dtype,
             ", random weights" if config.random_weights else "")
    return load_stage(config.checkpoint, stage, device=config.device, dtype=config.dtype,
                      random_weights=config.random_weights, seed=config.random_seed)
