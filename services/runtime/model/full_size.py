"""Qwen3-Omni-30B-A3B at its real shape without its weights: the layout, and random weights made
directly on the device.

`REAL_LAYOUT` holds the real checkpoint's sizes (Qwen/Qwen3-Omni-30B-A3B-Instruct config.json,
every field that shapes the state dict); `omni-tiny-checkpoint --full-size --no-weights` merges
it into the tiny checkpoint's config, so special token ids still fit the tiny tokenizer and
prompts work, and writes no weights. A stage started with `--random-weights` builds its module
from that config on its device and dtype and fills it with seeded random numbers: no transformers
init, no safetensors, seconds even at 31.7 B parameters (thinker 31.7 B, talker 3.3 B, code2wav
0.22 B: 65.7 GiB in bfloat16).

NOTE: init. Matrices get normal(0, 1/sqrt(fan_in)) so activations keep unit scale through the
layers (a fixed std of 0.02 or 0.2 collapses or explodes at hidden 2048), norms 1, biases 0;
code2wav follows the tiny checkpoint's init (services/tools/tiny_weights.py and
tiny_checkpoint.init_weights: gammas 1, log-scales 0, output scaled to an rms of about 0.2) so the
audio is audible; the codec EOS row of the talker head is zeroed so every request runs to its max
tokens (deterministic benchmark lengths).
"""

from __future__ import annotations

import copy
import math

from services.base.stages import Stage

# The real checkpoint's config in every field that shapes the state dict or changes compute (the
# sizes tests/runtime/model/test_checkpoint_loading.py checks the state dict against; routing
# normalisation, rotary bases, positions per second of audio/video, position limits). Merged over
# the tiny config: fields not named keep the tiny values or transformers' defaults, which match
# the real ones (audio/vision patching and windows, activations, norm epsilons, code2wav upsampling
# and its rope, codec special ids for codebook 2048); tests/gpu/test_full_size.py checks both.
REAL_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}
REAL_PREDICTOR_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
REAL_POSITION_ID_PER_SECONDS = 13
REAL_LAYOUT = dict(
    thinker_config=dict(
        text_config=dict(
            vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=768, rope_parameters=REAL_MROPE,
            norm_topk_prob=True, max_position_embeddings=65536,
        ),
        audio_config=dict(
            d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
            output_dim=2048, downsample_hidden_size=480,
        ),
        vision_config=dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
        ),
        position_id_per_seconds=REAL_POSITION_ID_PER_SECONDS,
    ),
    talker_config=dict(
        text_config=dict(
            vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
            num_attention_heads=16, num_key_value_heads=2, head_dim=128, num_experts=128,
            num_experts_per_tok=6, moe_intermediate_size=384, shared_expert_intermediate_size=768,
            rope_parameters=REAL_MROPE, norm_topk_prob=True, max_position_embeddings=32768,
        ),
        code_predictor_config=dict(
            vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
            rope_parameters=REAL_PREDICTOR_ROPE, max_position_embeddings=32768,
        ),
        num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24, spatial_merge_size=2,
        position_id_per_seconds=REAL_POSITION_ID_PER_SECONDS,
    ),
    code2wav_config=dict(
        codebook_size=2048, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=3072, decoder_dim=1536, sliding_window=72,
    ),
)


def merge_layout(base: dict, layout: dict) -> dict:
    """A copy of `base` with every value of `layout` put in, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for key, value in layout.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rope_parameters":
            out[key] = merge_layout(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_layout(config) -> None:
    """Raise ValueError where sizes that must agree do not (a hand-written layout's mistakes)."""
    th, tk = config.thinker_config, config.talker_config
    hidden = th.text_config.hidden_size
    problems = []
    for name, value in (("audio output_dim", th.audio_config.output_dim),
                        ("vision out_hidden_size", th.vision_config.out_hidden_size),
                        ("talker thinker_hidden_size", tk.thinker_hidden_size)):
        if value != hidden:
            problems.append(f"{name} {value} != thinker hidden {hidden}")
    if tk.accept_hidden_layer > th.text_config.num_hidden_layers:
        problems.append("talker accept_hidden_layer exceeds the thinker's layers")
    codebook = config.code2wav_config.codebook_size
    if tk.code_predictor_config.vocab_size != codebook or tk.text_config.vocab_size != codebook + 1024:
        problems.append("code predictor vocab must be the codebook size, talker vocab codebook + 1024")
    for name in ("codec_eos_token_id", "codec_pad_id", "codec_bos_id", "codec_nothink_id"):
        if not codebook <= getattr(tk, name) < codebook + 1024:
            problems.append(f"talker {name} outside [codebook, codebook + 1024)")
    for text in (th.text_config, tk.text_config):
        section = (text.rope_parameters or {}).get("mrope_section")
        if section and 2 * sum(section) != text.head_dim:
            problems.append(f"mrope_section {section} does not fill head_dim {text.head_dim}")
    if problems:
        raise ValueError("inconsistent layout: " + "; ".join(problems))


def fill_random_(model, gen) -> None:
    """Every parameter of `model` drawn in place from `gen`, in name order: matrices (and conv
    kernels) normal(0, 1/sqrt(fan_in)), SnakeBeta log-scales 0, norm weights, ConvNeXt gammas and
    layer scales 1, biases 0. The part of init_random_ both families share (Qwen2.5-Omni's modules
    have no gamma or layer scale); its stage fix-ups come after."""
    import torch
    from torch import nn

    convs = {id(p) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)
             for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                fan_in = p[0].numel() if id(p) in convs else p.shape[-1]
                p.normal_(0.0, 1.0 / math.sqrt(max(fan_in, 1)), generator=gen)
            elif name.endswith(("alpha", "beta")):  # SnakeBeta log-scales
                p.zero_()
            elif name.endswith(("gamma", ".scale", "weight")):  # ConvNeXt gamma, layer scale, norms
                p.fill_(1.0)
            else:  # biases
                p.zero_()


def init_random_(model, seed: int, stage: Stage, device) -> None:
    """Seeded in-place init on the model's device (see the module docstring)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random_(model, gen)
    with torch.no_grad():
        if stage == Stage.TALKER:
            model.codec_head.weight[model.config.codec_eos_token_id].zero_()
        if stage == Stage.CODE2WAV:
            _scale_vocoder_output(model, gen)


def _scale_vocoder_output(model, gen, rms_target: float = 0.2) -> None:
    import torch

    codes = torch.randint(0, model.config.codebook_size, (1, model.config.num_quantizers, 32), generator=gen,
                          device=gen.device)
    captured = []  # the last convolution's output, before the clamp to [-1, 1]
    hook = model.decoder[-1].register_forward_hook(lambda mod, inp, out: captured.append(out))
    with torch.inference_mode():
        model(codes)
    hook.remove()
    rms = captured[0].float().pow(2).mean().sqrt().item()
    model.decoder[-1].conv.weight.mul_(rms_target / max(rms, 1e-6))


def build_random_stage(cls, sub_config, stage: Stage, device: str, dtype, seed: int = 0, init=None):
    """The stage module built on `device` in `dtype` with seeded random weights, in eval mode.
    `init`: the family's init_random_ (default: this module's, Qwen3-Omni's).

    NOTE: `no_init_weights` turns transformers' and torch's initialisers into no-ops, and the
    device context allocates every parameter on the device directly (no CPU copy, no meta pass):
    init_random_ is then one normal_ per tensor on the device. Buffers (rotary frequencies, codec
    offsets) are computed in the constructors, so they are real."""
    import torch
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = cls._from_config(sub_config, dtype=dtype)
    model.eval()
    (init or init_random_)(model, seed, stage, torch.device(device))
    return model
