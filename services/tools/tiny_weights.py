"""The weights of the tiny checkpoints and how their folders are written, shared by both families
(services/tools/tiny_checkpoint.py for Qwen3-Omni, services/tools/tiny_qwen2_5_omni.py for
Qwen2.5-Omni); each family then fixes up its own head rows and vocoder output level.

NOTE: init. The LMs get normal(0, 0.2) matrices, so greedy decoding does not collapse onto one
token; their norms and biases keep transformers' 1 and 0. The vocoder (code2wav, Token2Wav) gets a
fan-in scaled normal (kaiming-like, gain 1) so its audio is audible rather than near-silent, norm
weights, ConvNeXt gammas and layer scales 1 (transformers starts the gammas at 1e-6), SnakeBeta
log-scales and biases 0. Parameters are drawn in name order from one generator: same seed, same
bytes.
"""

from __future__ import annotations

import math
from pathlib import Path


def init_weights_(model, gen, vocoder: str) -> None:
    """Draw every parameter of `model` in place from `gen` (see the module docstring); `vocoder`:
    the name prefix of the vocoder's parameters ("code2wav." or "token2wav.")."""
    import torch

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith(vocoder):
                if name.endswith(("gamma", ".scale")):  # ConvNeXt gamma, layer scale
                    p.fill_(1.0)
                elif name.endswith(("alpha", "beta")):  # SnakeBeta log-scales
                    p.zero_()
                elif p.ndim == 1 and "norm" in name:
                    p.fill_(1.0)
                elif p.ndim == 1:
                    p.zero_()
                elif name.endswith("codec_embed.weight"):  # Token2Wav's code embedding: unit scale, no fan-in
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:
                    fan_in = p[0].numel() if p.ndim > 1 else p.numel()
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(fan_in, 1)))
            elif p.ndim == 1:
                continue  # norms keep 1, biases keep 0
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def save_config_only(out: Path, config) -> None:
    """config.json and no weights (for stages started with --random-weights): a folder re-written
    without weights loses the ones an earlier build left."""
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    config.save_pretrained(out)


def save_model(out: Path, model) -> None:
    """config.json and model.safetensors as save_pretrained writes them, without the
    generation_config.json it adds: the tiny folders have none, so generate's defaults come from
    the config, as for a checkpoint that ships none."""
    model.save_pretrained(out, safe_serialization=True)
    gen_config = out / "generation_config.json"
    if gen_config.exists():
        gen_config.unlink()
