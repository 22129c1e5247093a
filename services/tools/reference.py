"""`omni-reference`: transformers' own `Qwen3OmniMoeForConditionalGeneration.generate`, greedy.

The correctness oracle (the pipeline's text ids and codec frames must equal these) and the speed
baseline (the stages run one after the other, nothing streamed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from services.runtime.checkpoint import check_folder
from services.runtime.errors import InvalidArgument, UserError, run_cli
from services.runtime.prompt import (
    ChatMessage,
    Part,
    PromptBuilder,
    Role,
    resolve_voice,
)


@dataclass(frozen=True)
class ReferenceResult:
    text: str
    thinker_token_ids: list[int]  # generated ids, the end token included when emitted
    codec_frames: list[list[int]]  # [frames][num_code_groups], as handed to code2wav
    audio: np.ndarray  # float32 [samples], generate's own waveform
    sample_rate: int
    prompt_tokens: int
    wall_s: float

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("audio")
        out["audio_seconds"] = self.audio_seconds
        return out


class ReferenceRunner:
    """The full transformers model, loaded once; one greedy `generate` per call."""

    def __init__(self, checkpoint: str | Path, device: str = "cpu", dtype: str = "float32"):
        import torch
        import transformers
        from transformers import Qwen3OmniMoeForConditionalGeneration

        folder = check_folder(checkpoint)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            # Loaded in `dtype` directly: a 30B checkpoint does not fit host memory as float32.
            self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(folder), dtype=getattr(torch, dtype))
            self.prompts = PromptBuilder(folder, self.model.config)
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.model.to(device).eval()
        self.device = device
        self.config = self.model.config
        # transformers bug: audio + image in one prompt fails in the talker without this
        # (docs/qwen3-omni.md, section "transformers quirks").
        if not hasattr(self.config.talker_config, "audio_config"):
            self.config.talker_config.audio_config = self.config.thinker_config.audio_config
        self.eos_id = self.config.im_end_token_id
        self.sample_rate = 24000

    def generate(
        self,
        messages: list[ChatMessage],
        voice: str | None = None,
        max_new_tokens: int = 64,
        talker_max_new_tokens: int = 256,
        return_audio: bool = True,
        forced_ids: list[int] | None = None,
    ) -> ReferenceResult:
        """`forced_ids`: make the thinker produce exactly these ids (text-to-speech oracle): a logits
        processor leaves only the next forced id finite at each step, so greedy `generate` picks it and
        the rest of `generate` (hidden states, talker, vocoder) runs unchanged on that output."""
        import torch

        name, _ = resolve_voice(self.config, voice)
        inputs = self.prompts.build(messages)
        model_inputs = {k: v.to(self.device) for k, v in inputs.model_kwargs().items()}
        captured = []  # the codes generate hands to the vocoder, [1, Q, frames]
        original = self.model.code2wav.chunked_decode if return_audio else None

        def capture(codes, *args, **kwargs):
            captured.append(codes.detach().clone())
            return original(codes, *args, **kwargs)

        forcing = {}
        if forced_ids:
            from transformers import LogitsProcessorList

            forcing = {"thinker_logits_processor": LogitsProcessorList([_ForceIds(forced_ids, inputs.num_tokens)])}
            max_new_tokens = len(forced_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            if return_audio:
                self.model.code2wav.chunked_decode = capture
                try:
                    sequences, wav = self.model.generate(
                        **model_inputs, speaker=name, return_audio=True,
                        thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=self.eos_id,
                        thinker_do_sample=False, talker_max_new_tokens=talker_max_new_tokens,
                        talker_do_sample=False, **forcing,
                    )
                finally:
                    del self.model.code2wav.chunked_decode
            else:
                sequences = self.model.generate(
                    **model_inputs, return_audio=False, thinker_max_new_tokens=max_new_tokens,
                    thinker_eos_token_id=self.eos_id, thinker_do_sample=False, **forcing,
                )
                wav = None
        wall = time.perf_counter() - start
        ids = sequences[0, inputs.num_tokens:].cpu().tolist()
        frames = captured[0][0].T.tolist() if captured else []
        audio = wav.reshape(-1).float().cpu().numpy() if wav is not None else np.zeros(0, np.float32)
        return ReferenceResult(
            text=self.prompts.decode(ids), thinker_token_ids=ids, codec_frames=frames, audio=audio,
            sample_rate=self.sample_rate, prompt_tokens=inputs.num_tokens, wall_s=wall,
        )


class _ForceIds:
    """A transformers logits processor: at step k only forced[k] stays finite."""

    def __init__(self, forced: list[int], prompt_len: int):
        self.forced = list(forced)
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        import torch

        step = input_ids.shape[1] - self.prompt_len
        keep = self.forced[min(step, len(self.forced) - 1)]
        out = torch.full_like(scores, float("-inf"))
        out[:, keep] = scores[:, keep]
        return out


def messages_from_args(prompt: str, system: str | None, audio: Path | None, image: Path | None) -> list[ChatMessage]:
    """The CLI's --prompt/--system/--audio/--image as chat messages (files read here)."""
    parts = []
    for path, kind in ((audio, "audio"), (image, "image")):
        if path is not None:
            if not path.is_file():
                raise UserError(f"--{kind} {path}: file not found")
            parts.append(Part(**{kind: path.read_bytes()}))
    parts.append(Part(text=prompt))
    messages = [ChatMessage(Role.SYSTEM, (Part(text=system),))] if system else []
    return messages + [ChatMessage(Role.USER, tuple(parts))]


def cli_flag(field: str) -> str:
    """A request field named by InvalidArgument -> the CLI flag that set it."""
    for part, flag in (("audio", "--audio"), ("image", "--image"), ("voice", "--voice")):
        if field.endswith(part):
            return flag
    return "--prompt" if field.startswith("messages") else field


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), audio, sample_rate, subtype="FLOAT")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-reference", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system")
    parser.add_argument("--audio", type=Path, help="a wav/flac file to put in the user turn")
    parser.add_argument("--image", type=Path, help="a png/jpeg file to put in the user turn")
    parser.add_argument("--voice", help="speaker name (default: the checkpoint's default)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--talker-max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, help="write the audio here (.wav)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    def run() -> None:
        messages = messages_from_args(args.prompt, args.system, args.audio, args.image)  # files first
        runner = ReferenceRunner(args.checkpoint)
        try:
            result = runner.generate(messages, args.voice, args.max_new_tokens, args.talker_max_new_tokens)
        except InvalidArgument as exc:
            raise UserError(f"{cli_flag(exc.field)}: {str(exc).split(': ', 1)[1]}") from None
        if args.out:
            write_wav(args.out, result.audio, result.sample_rate)
        if args.json:
            print(json.dumps(result.summary()))
        else:
            print(result.text)
            print(f"{len(result.codec_frames)} frames, {result.audio_seconds:.2f} s audio, {result.wall_s:.2f} s wall",
                  file=sys.stderr)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
