"""Bench presets: which generated checkpoint and how much work per request.

- `tiny` (`make bench`): the tiny checkpoint (about a million parameters), where per-step Python
  and dispatch dominate: it measures the serving stack's overhead.
- `wide` (`omni-bench --preset wide`): a generated checkpoint with wider layers (about 45 M
  parameters; thinker hidden 512, talker and code predictor hidden 512), written once to
  `models/wide-qwen3-omni` in seconds (no download), where the matrix products dominate a step:
  it measures batching efficiency (what a batched step costs against one row).

Both keep the tiny tokenizer and the real checkpoint's structure (MoE thinker and talker,
16-codebook code predictor, vocoder), so every system runs exactly as on the tiny one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.tools.tiny_checkpoint import build

_WIDE_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [12, 10, 10], "interleaved": True}
WIDE_HIDDEN = 512  # thinker; also the audio/vision outputs and the talker's thinker_hidden_size
WIDE_TALKER_HIDDEN = 512  # talker and code predictor (the predictor reads the talker's hidden state)
WIDE_LAYOUT = dict(
    thinker_config=dict(
        text_config=dict(hidden_size=WIDE_HIDDEN, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=512, rope_parameters=_WIDE_MROPE,
                         norm_topk_prob=True),
        audio_config=dict(output_dim=WIDE_HIDDEN),
        vision_config=dict(out_hidden_size=WIDE_HIDDEN),
    ),
    talker_config=dict(
        text_config=dict(hidden_size=WIDE_TALKER_HIDDEN, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                         rope_parameters=_WIDE_MROPE, norm_topk_prob=True),
        code_predictor_config=dict(hidden_size=WIDE_TALKER_HIDDEN, intermediate_size=1536, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        thinker_hidden_size=WIDE_HIDDEN, accept_hidden_layer=2,
    ),
    code2wav_config=dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                         decoder_dim=64),
)


@dataclass(frozen=True)
class Preset:
    name: str
    checkpoint: Path | None  # generated here when missing; None: --checkpoint is required
    layout: dict | None
    max_new_tokens: int
    talker_max_new_tokens: int
    requests: int
    rounds: int


PRESETS = {
    "tiny": Preset("tiny", None, None, max_new_tokens=32, talker_max_new_tokens=64, requests=6, rounds=2),
    # Fewer tokens and one round: each frame costs milliseconds of compute here.
    "wide": Preset("wide", Path("models/wide-qwen3-omni"), WIDE_LAYOUT, max_new_tokens=16,
                   talker_max_new_tokens=32, requests=4, rounds=1),
}


def ensure_checkpoint(preset: Preset, folder: Path | None = None, seed: int = 0) -> Path:
    """The preset's checkpoint folder, written (seeded, no download) when it has no weights yet."""
    folder = Path(folder or preset.checkpoint)
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():

        build(folder, seed=seed, layout=preset.layout)
    return folder
