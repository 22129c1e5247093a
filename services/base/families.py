"""Model families the services serve, told apart by the checkpoint's config.json `model_type`.

Qwen3-Omni (`qwen3_omni_moe`): a MoE thinker, a talker that emits one 16-codebook frame per step
(its code predictor fills codebooks 1-15), and a convolutional vocoder (Code2Wav).
Qwen2.5-Omni (`qwen2_5_omni`): a dense thinker, a talker that emits one codec token per step from
the thinker's embeddings plus last hidden states, and Token2Wav (a DiT flow-matching model, then
BigVGAN). Each stage keeps its family-specific code in one place (docs/architecture.md, Families);
everything else (services, router, admission, metrics, TLS, k8s, bench) is shared.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

from services.base.errors import UserError


class Family(enum.Enum):
    QWEN3_OMNI = "qwen3_omni_moe"
    QWEN2_5_OMNI = "qwen2_5_omni"


# The voice a request without one gets, as its checkpoint spells it (a checkpoint without it: its
# first voice). Qwen3-Omni: the project's choice among the config's speakers; Qwen2.5-Omni:
# generate's own `speaker` default among spk_dict.pt's voices. Names match case-insensitively.
DEFAULT_VOICES = {Family.QWEN3_OMNI: "ethan", Family.QWEN2_5_OMNI: "Chelsie"}


def family_of(folder: str | Path) -> Family:
    """The family of the checkpoint in `folder`, from its config.json `model_type`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"not an omni checkpoint (no config.json): {Path(folder)}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    try:
        return Family(model_type)
    except ValueError:
        known = ", ".join(repr(f.value) for f in Family)
        raise UserError(f"{Path(folder)}: model_type is {model_type!r}, expected one of {known}") from None
