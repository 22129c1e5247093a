"""`omni-tiny-checkpoint`: write a complete, tiny, random-weight Qwen3-Omni (or, with `--family
qwen2_5_omni`, Qwen2.5-Omni: services/tools/tiny_qwen2_5_omni.py) checkpoint folder.

The folder has the Hugging Face layout of Qwen/Qwen3-Omni-30B-A3B-Instruct (config.json,
model.safetensors with `thinker.*`, `talker.*`, `code2wav.*` keys, tokenizer and processor
files) at about a million parameters, so tests and `make run` need no network.

NOTE: weights. transformers' default initialisation gives a near-silent vocoder (peak about
7e-7: normal(0, 0.02) weights shrink the signal through a dozen convolutions, and the ConvNeXt
gammas start at 1e-6). Every code2wav weight matrix is re-drawn here with a fan-in scaled std
(kaiming-like, gain 1) and the ConvNeXt / layer-scale gammas set to 1, which yields audible
audio with peaks of order 0.1-1. The LMs keep a larger std too, so greedy decoding does not
collapse onto one token. Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.base.errors import UserError, run_cli
from services.base.families import Family
from services.runtime.model.full_size import REAL_LAYOUT, check_layout, merge_layout
from services.runtime.model.full_size_qwen2_5 import REAL_LAYOUT as QWEN2_5_REAL_LAYOUT
from services.tools import tiny_qwen2_5_omni
from services.tools.tiny_tokenizer import train_tokenizer, write_preprocessor_config, write_video_preprocessor_config
from services.tools.tiny_weights import init_weights_, save_config_only, save_model

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
]

# Speakers of the real checkpoint, in its order.
SPEAKERS = ["chelsie", "ethan", "aiden"]

CODEBOOK_SIZE = 64
TEXT_HIDDEN = 32
TALKER_HIDDEN = 32

# Qwen-style chat template: system/user/assistant turns, audio and image parts as placeholders
# that the prompt builder expands to one pad token per encoder output position. Tools as Qwen3-Omni's
# own template renders them: a `# Tools` system turn (the system message's text first) listing each
# function's JSON in <tools></tools>, an assistant's calls as <tool_call>{"name", "arguments"}
# </tool_call> after its text, and tool results as <tool_response> blocks in one user turn per run.
# Without tools the turns are as before.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] == 'audio' -%}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ render(messages[0]['content']) + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ render(message['content']) }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}{{ '\\n' }}{%- endif -%}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string -%}{{ call['arguments'] }}{%- else -%}{{ call['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# The attribute names Qwen3-Omni's own tokenizer_config uses (prompt.py reads them).
TOKEN_ATTRIBUTES = {
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def build_tokenizer(out: Path) -> dict[str, int]:
    """Train the tiny byte-level BPE with Qwen3-Omni's special tokens; save tokenizer files; return special ids."""
    return train_tokenizer(out, SPECIAL_TOKENS, CHAT_TEMPLATE, TOKEN_ATTRIBUTES)


def write_processor_files(out: Path) -> None:
    """Feature extractor (Whisper, 128 mel bins) and image processor (Qwen2-VL, 16-pixel patches), small sizes."""
    write_preprocessor_config(out, patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    write_video_preprocessor_config(out, patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


HEAD_DIM = 16
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "interleaved": True}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)


def build_config(ids: dict[str, int], layout: dict | None = None):
    """The tiny config; `layout` (nested dicts of sizes, e.g. full_size.REAL_LAYOUT) is merged over
    it, while every special token id stays the tiny tokenizer's."""
    from transformers import Qwen3OmniMoeConfig

    layout = layout or {}
    codebook = layout.get("code2wav_config", {}).get("codebook_size", CODEBOOK_SIZE)
    stages = merge_layout(dict(thinker_config=thinker_config(ids), talker_config=talker_config(ids, codebook),
                               code2wav_config=code2wav_config(codebook)), layout)
    config = Qwen3OmniMoeConfig(
        **stages, enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )
    check_layout(config)
    return config


def thinker_config(ids: dict[str, int]) -> dict:
    """The thinker: a 2-layer MoE text model, a 1-layer audio encoder and a 1-block vision encoder."""
    text = dict(
        vocab_size=ids["vocab_size"],  # every id the thinker can emit decodes
        hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=4096,
        rope_parameters=MROPE, **MOE,
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
        output_dim=TEXT_HIDDEN, downsample_hidden_size=8, n_window=50, n_window_infer=800,
        max_source_positions=1500, conv_chunksize=500,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT_HIDDEN,
        num_position_embeddings=256, deepstack_visual_indexes=[0],
    )
    return dict(
        text_config=text, audio_config=audio, vision_config=vision,
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
        vision_start_token_id=ids["<|vision_start|>"], user_token_id=ids["user"], position_id_per_seconds=25,
    )


def talker_config(ids: dict[str, int], codebook: int) -> dict:
    """The talker: a 2-layer MoE codec LM and a 1-layer code predictor over 16 codebooks."""
    special = codebook  # codec specials and speakers live in [codebook, codebook + 1024)
    text = dict(
        vocab_size=codebook + 1024, hidden_size=TALKER_HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
        max_position_embeddings=4096, rope_parameters=MROPE, shared_expert_intermediate_size=32, **MOE,
    )
    code_predictor = dict(
        vocab_size=codebook, hidden_size=TALKER_HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, num_code_groups=16,
        max_position_embeddings=64,
    )
    return dict(
        text_config=text, code_predictor_config=code_predictor, num_code_groups=16,
        thinker_hidden_size=TEXT_HIDDEN, accept_hidden_layer=1, spatial_merge_size=2,
        codec_eos_token_id=special + 102, codec_pad_id=special + 100, codec_bos_id=special + 101,
        codec_nothink_id=special + 107, codec_think_bos_id=special + 108, codec_think_eos_id=special + 109,
        speaker_id={name: special + 253 + i for i, name in enumerate(SPEAKERS)},
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        audio_start_token_id=ids["<|audio_start|>"], position_id_per_seconds=25,
    )


def code2wav_config(codebook: int) -> dict:
    return dict(
        codebook_size=codebook, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, sliding_window=8, intermediate_size=64, num_quantizers=16,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32, max_position_embeddings=8000,
    )


def init_weights(model, seed: int) -> None:
    """Seeded init that makes every stage do something visible: tiny_weights.init_weights_, then this
    family's head rows and output level (see module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    init_weights_(model, gen, "code2wav.")
    with torch.no_grad():
        # Random weights would end the speech after a few frames or never; make the codec EOS
        # logit 0 so greedy decoding runs to talker max tokens, which gives tests long,
        # deterministic audio (docs/qwen3-omni.md, section "Random weights").
        eos = model.config.talker_config.codec_eos_token_id
        model.talker.codec_head.weight[eos].zero_()
        # Scale the vocoder's last (linear) convolution so that audio has an rms of about 0.2
        # rather than clipping at +-1.
        codes = torch.randint(0, CODEBOOK_SIZE, (1, 16, 32), generator=gen)
        captured = []  # the output of the last convolution, before the clamp to [-1, 1]
        hook = model.code2wav.decoder[-1].register_forward_hook(lambda mod, inp, out: captured.append(out))
        model.code2wav(codes)
        hook.remove()
        rms = captured[0].pow(2).mean().sqrt().item()
        model.code2wav.decoder[-1].conv.weight.mul_(0.2 / max(rms, 1e-6))


# The EOS variant (`build(..., eos=True)`): each end token's head row points along the mean direction
# of its LM's final hidden states, scaled so its logit is this fraction of the typical winning logit.
# Measured on the seed-0 checkpoint: the thinker ends after 3 to 6 tokens on every prompt tried, the
# talker after 23 to 68 frames on four prompts of six (tests/e2e/test_eos.py uses some of both); a
# larger talker scale makes some prompts end on the first step, where generate fails.
THINKER_EOS_SCALE = 0.85
TALKER_EOS_SCALE = 0.7
CALIBRATION_PROMPTS = ("Hello! How are you today?", "Tell me a long story.", "Please describe the picture.")


def make_eos_win(model, folder: Path, ids: dict[str, int]) -> None:
    """Re-point the thinker's <|im_end|> row and the talker's codec EOS row (see EOS_SCALE above),
    measured on greedy runs of a few fixed chat prompts (deterministic: same weights, same rows)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompts = [torch.tensor([tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n").ids])
               for p in CALIBRATION_PROMPTS]

    def point(head: torch.nn.Linear, row: int, hidden: torch.Tensor, scale: float, columns: int) -> None:
        direction = hidden.mean(0) / hidden.mean(0).norm()
        winning = (hidden @ head.weight[:columns].T).max(-1).values.mean()
        head.weight[row] = direction * scale * winning / (hidden @ direction).mean()

    with torch.no_grad():
        hidden = torch.cat([model.thinker(input_ids=p, output_hidden_states=True).hidden_states[-1][0] for p in prompts])
        point(model.thinker.lm_head, ids["<|im_end|>"], hidden, THINKER_EOS_SCALE, ids["vocab_size"])
        seen = []  # the talker's final hidden states, as its codec head gets them
        hook = model.talker.codec_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0][0]))
        for p in prompts[:2]:
            model.generate(input_ids=p, attention_mask=torch.ones_like(p), speaker="ethan", thinker_max_new_tokens=8,
                           thinker_do_sample=False, talker_max_new_tokens=12, talker_do_sample=False,
                           thinker_eos_token_id=ids["<|im_end|>"])
        hook.remove()
        codebook = model.config.talker_config.code_predictor_config.vocab_size
        point(model.talker.codec_head, model.config.talker_config.codec_eos_token_id, torch.cat(seen),
              TALKER_EOS_SCALE, codebook)


def build(out: Path, seed: int, layout: dict | None = None, weights: bool = True, eos: bool = False) -> Path:
    """Write the folder. `layout`: sizes merged over the tiny ones (full_size.REAL_LAYOUT for the
    real shape). `weights=False`: config, tokenizer and processor files only, for stages started
    with --random-weights. `eos=True`: the end tokens can win (`make_eos_win`), so greedy decoding
    reaches the thinker's <|im_end|> and the talker's codec EOS before the limits."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out)
    write_processor_files(out)
    config = build_config(ids, layout)
    if not weights:
        save_config_only(out, config)
        return out
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    init_weights(model, seed)
    if eos:
        make_eos_win(model, out, ids)
    save_model(out, model)
    return out


# What --full-size writes no weights for, per family (every parameter in bfloat16).
FULL_SIZE_BYTES = {Family.QWEN3_OMNI: "65.7 GiB in bfloat16", Family.QWEN2_5_OMNI: "20.0 GiB in bfloat16"}
FAMILY_NAMES = {Family.QWEN3_OMNI: "Qwen3-Omni", Family.QWEN2_5_OMNI: "Qwen2.5-Omni"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-tiny-checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write (created)")
    parser.add_argument("--family", choices=[f.value for f in Family], default=Family.QWEN3_OMNI.value,
                        help="model family (config.json model_type; default qwen3_omni_moe)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--full-size", action="store_true",
                        help="the real layout (Qwen3-Omni-30B-A3B or Qwen2.5-Omni-7B; special ids of the tiny "
                             "tokenizer); needs --no-weights")
    parser.add_argument("--layout", type=Path,
                        help="JSON of sizes merged over the tiny config (nested like config.json), e.g. a scaled-down "
                             "full-size layout")
    parser.add_argument("--eos", action="store_true",
                        help="end tokens that win: the thinker and the talker stop before their limits on most prompts")
    parser.add_argument("--no-weights", action="store_true",
                        help="write config, tokenizer and processor files only: start stages with --random-weights")
    args = parser.parse_args(argv)
    family = Family(args.family)
    builder = {Family.QWEN3_OMNI: build, Family.QWEN2_5_OMNI: tiny_qwen2_5_omni.build}[family]
    real_layout = {Family.QWEN3_OMNI: REAL_LAYOUT, Family.QWEN2_5_OMNI: QWEN2_5_REAL_LAYOUT}[family]

    def run() -> None:
        if args.out.exists() and not args.out.is_dir():
            raise UserError(f"--out {args.out}: exists and is not a folder")
        if args.full_size and not args.no_weights:
            raise UserError(f"--full-size writes no weights ({FULL_SIZE_BYTES[family]}): add --no-weights and start "
                            "the stages with --random-weights")
        layout = real_layout if args.full_size else None
        if args.layout is not None:
            try:
                layout = json.loads(args.layout.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"--layout {args.layout}: {exc}") from None
        try:
            builder(args.out, args.seed, layout, weights=not args.no_weights, eos=args.eos)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        size = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
        kind = "full-size" if args.full_size else "custom-layout" if args.layout else "tiny"
        weights = "no weights: start stages with --random-weights" if args.no_weights else f"seed {args.seed}"
        print(f"wrote {kind} {FAMILY_NAMES[family]} checkpoint to {args.out} ({size:.1f} MB, {weights})")

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
