"""Per-stage checkpoint loading: only the thinker, only the talker, or only code2wav, of either family.

A checkpoint folder holds one state dict with keys `thinker.*`, `talker.*` and the vocoder's
(`code2wav.*` for Qwen3-Omni, `token2wav.*` for Qwen2.5-Omni) in one or several safetensors files;
its config.json `model_type` names the family (services/base/families.py). Each stage class is
loaded with transformers' own `from_pretrained` and the stage's key prefix as `base_model_prefix`:
safetensors are read lazily, so the other stages' tensors are skipped, never materialised. The same
code serves the tiny checkpoints and the real ones (sharded, with an index file).

Qwen2.5-Omni's code2wav stage is its Token2Wav (DiT + BigVGAN), always in float32 whatever `dtype`
asks (transformers' own model keeps it there: `self.token2wav.float()`). Its voices live beside
the weights in spk_dict.pt (`load_voices`): the thinker stage needs a voice's `bos_token`, the
code2wav stage its `cond` and `ref_mel`.

`random_weights=True` reads config.json only and builds the stage on the device with seeded
random weights (services/runtime/model/full_size.py, full_size_qwen2_5.py): the real model's shape
without its weights.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import Qwen2_5OmniConfig, Qwen3OmniMoeConfig
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as q25
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from services.base.errors import UserError
from services.base.families import Family, family_of
from services.base.stages import Stage
from services.runtime.model import full_size_qwen2_5
from services.runtime.model.full_size import build_random_stage
from services.runtime.model.settings import ModelConfig

log = logging.getLogger(__name__)


def check_folder(folder: str | Path, need_weights: bool = True) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"checkpoint folder not found: {path}")
    family_of(path)  # a UserError unless config.json names a known family
    if need_weights and not any(path.glob("*.safetensors")):
        raise UserError(f"{path}: no .safetensors weights (for random weights at this shape: --random-weights)")
    return path


CONFIG_CLASSES = {Family.QWEN3_OMNI: Qwen3OmniMoeConfig, Family.QWEN2_5_OMNI: Qwen2_5OmniConfig}


def load_config(folder: str | Path, need_weights: bool = True):
    """The full config of the folder's family (Qwen3OmniMoeConfig or Qwen2_5OmniConfig)."""
    path = check_folder(folder, need_weights)
    return CONFIG_CLASSES[family_of(path)].from_pretrained(path)


def _stage_classes(family: Family = Family.QWEN3_OMNI):
    """Stage -> (the stage's module class, the name of its sub-config in the full config)."""
    if family is Family.QWEN2_5_OMNI:
        return {
            Stage.THINKER: (q25.Qwen2_5OmniThinkerForConditionalGeneration, "thinker_config"),
            Stage.TALKER: (q25.Qwen2_5OmniTalkerForConditionalGeneration, "talker_config"),
            Stage.CODE2WAV: (Token2WavFromCheckpoint, "token2wav_config"),
        }
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


class Token2WavFromCheckpoint(q25.Qwen2_5OmniToken2WavModel):
    """Qwen2.5-Omni's Token2Wav (prefix `model` in transformers) loaded from its `token2wav.` keys."""

    base_model_prefix = "token2wav"


@dataclass(frozen=True)
class LoadedStage:
    stage: Stage
    model: object  # the torch module, in eval mode
    config: object  # the full config: Qwen3OmniMoeConfig or Qwen2_5OmniConfig
    family: Family = Family.QWEN3_OMNI


def load_stage(folder: str | Path, stage: Stage, device: str = "cpu", dtype: str = "float32",
               random_weights: bool = False, seed: int = 0) -> LoadedStage:
    """Load one stage's module on `device` in `dtype` without reading the other stages
    (or, with `random_weights`, build it there from config.json with seeded random weights).
    Qwen2.5-Omni's code2wav stage (Token2Wav) is float32 whatever `dtype` says."""
    config = load_config(folder, need_weights=not random_weights)
    family = family_of(folder)
    cls, sub_name = _stage_classes(family)[stage]
    sub_config = getattr(config, sub_name)
    if family is Family.QWEN2_5_OMNI and stage is Stage.CODE2WAV:
        dtype = "float32"
    if family is Family.QWEN3_OMNI and stage is Stage.TALKER and not hasattr(sub_config, "audio_config"):
        # transformers bug: the talker's multimodal rope reads its config's audio config
        # (docs/qwen3-omni.md, section "transformers quirks").
        sub_config.audio_config = config.thinker_config.audio_config
    if random_weights:
        init = full_size_qwen2_5.init_random_ if family is Family.QWEN2_5_OMNI else None
        model = build_random_stage(cls, sub_config, stage, device, getattr(torch, dtype), seed, init=init)
        return LoadedStage(stage=stage, model=model, config=config, family=family)
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
    return LoadedStage(stage=stage, model=model, config=config, family=family)


@dataclass(frozen=True)
class Voice:
    """One Qwen2.5-Omni voice from spk_dict.pt."""

    name: str
    bos_token: int  # thinker-vocabulary id whose embedding starts the talker's reply (after the prompt)
    cond: torch.Tensor  # [1, enc_emb_dim] float32: Token2Wav's speaker embedding
    ref_mel: torch.Tensor  # [1, frames, mel_dim] float32: Token2Wav's reference mel spectrogram


VOICES_FILE = "spk_dict.pt"


def load_voices(folder: str | Path) -> dict[str, Voice]:
    """A Qwen2.5-Omni checkpoint's voices: name (as spelled in spk_dict.pt, e.g. "Chelsie") -> Voice.
    Read with torch.load(weights_only=True), as transformers' `load_speakers` does."""
    path = Path(folder) / VOICES_FILE
    if family_of(folder) is not Family.QWEN2_5_OMNI:
        raise UserError(f"{Path(folder)}: voices come from spk_dict.pt in Qwen2.5-Omni checkpoints only")
    if not path.is_file():
        raise UserError(f"{Path(folder)}: no {VOICES_FILE} (the voices of a Qwen2.5-Omni checkpoint)")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch.load raises several types for a damaged or foreign file
        raise UserError(f"{path}: not a readable voice file ({type(exc).__name__})") from None
    voices = {}
    for name, entry in data.items() if isinstance(data, dict) else ():
        try:
            voices[name] = Voice(name=name, bos_token=int(entry["bos_token"]), cond=entry["cond"].float(),
                                 ref_mel=entry["ref_mel"].float())
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UserError(f"{path}: voice {name!r} needs bos_token, cond and ref_mel") from None
        if voices[name].cond.ndim != 2 or voices[name].ref_mel.ndim != 3:
            raise UserError(f"{path}: voice {name!r}: cond must be [1, dim], ref_mel [1, frames, mel_dim]")
    if not voices:
        raise UserError(f"{path}: no voices")
    return voices


def voice_bos_tokens(folder: str | Path) -> dict[str, int]:
    """voice name -> its bos_token (a thinker token id): what the thinker stage needs of `load_voices`."""
    return {name: voice.bos_token for name, voice in load_voices(folder).items()}


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
