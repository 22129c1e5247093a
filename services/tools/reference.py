"""`omni-reference`: transformers' own `generate` of the checkpoint's family, greedy.

Qwen3-Omni: `Qwen3OmniMoeForConditionalGeneration.generate`; Qwen2.5-Omni:
`Qwen2_5OmniForConditionalGeneration.generate` (its inputs from `Qwen2_5OmniProcessor`).

The correctness oracle (the pipeline's text ids and codec frames must equal these) and the speed
baseline (the stages run one after the other, nothing streamed). `ReferenceRunner.generate` can
also sample, from torch's global generator seeded per call.

The oracle shares no input code with the pipeline: it never uses services/runtime/inputs/prompt.py's
`PromptBuilder`. Its inputs come from transformers' own `Qwen3OmniMoeProcessor.apply_chat_template
(tokenize=True, return_dict=True)`, which renders the chat template and calls the processor's
`__call__`: the Whisper feature extractor, the Qwen2-VL image processor and the processor's own
placeholder expansion (`replace_multimodal_special_tokens`, one pad per encoder position); for a
Qwen2.5-Omni checkpoint the same through `Qwen2_5OmniProcessor`. Only
the processor's construction is ours: its video processor needs torchvision, which does not
import beside the CPU torch wheel, so `oracle_processor` builds the processor class with
`video_processor` set to `NoVideo`, a stand-in that only carries `merge_size` (read by the
placeholder expansion) and raises if it is ever called; the subclass `ProcessorWithoutVideo`
overrides nothing but the type check of that one argument. The bytes of a request become what
the processor takes the way a user of transformers would: soundfile reads wav/flac (channels
averaged, as librosa's mono load does; 16 kHz only, so the pipeline's resampler is never used),
PIL opens png/jpeg (the image processor converts to RGB itself). The chat template is the one
`from_pretrained` gives a processor (the folder's chat_template.jinja or chat_template.json);
only a folder with neither falls back to the tokenizer's.

Qwen2.5-Omni differences (docs/qwen2_5-omni.md): one codec id per frame (`codec_frames` rows of
one id); voices are spk_dict.pt's names, matched case-insensitively ("ethan" -> "Ethan"), the
default generate's own (Chelsie); and
Token2Wav starts its flow from `torch.randn` drawn from torch's global generator, so every call
seeds it (`seed`, default `TOKEN2WAV_SEED`) just before `generate`: with greedy decoding nothing
else draws from it, so the noise is the first [1, 2 * codes, 80] normal draw after
`torch.manual_seed(seed)`.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from services.base.errors import InvalidArgument, UserError, run_cli
from services.base.families import DEFAULT_VOICES, Family, family_of
from services.base.stages import SPEECH_SAMPLE_RATE
from services.runtime.inputs.prompt import ChatMessage, Part, Role  # plain data classes: the request's messages
from services.runtime.lm.invariance import experts_modules
from services.runtime.lm.kernels import (
    GEMM_KERNELS,
    use_exact_experts,
    use_exact_rotary,
    use_invariant_attention,
    using_kernels,
)
from services.runtime.model.checkpoint import check_folder

AUDIO_SAMPLE_RATE = 16000  # the Whisper feature extractor's rate; the oracle resamples nothing
TOKEN2WAV_SEED = 0  # Qwen2.5-Omni: the global seed set before generate when the call names none


@dataclass(frozen=True)
class ReferenceResult:
    text: str
    thinker_token_ids: list[int]  # generated ids, the end token included when emitted
    codec_frames: list[list[int]]  # [frames][code groups: 16 for Qwen3-Omni, 1 for Qwen2.5-Omni], as handed to code2wav
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


class NoVideo:
    """Stands in for the omni processors' video processor (torchvision): never called, carries merge_size."""

    def __init__(self, merge_size: int):
        self.merge_size = merge_size
        self.model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __call__(self, *args, **kwargs):
        raise AssertionError("the oracle takes no video")


def oracle_processor(folder: str | Path):
    """transformers' processor of the folder's family (`Qwen3OmniMoeProcessor` or `Qwen2_5OmniProcessor`)
    on the checkpoint's tokenizer, feature extractor and image processor, with the chat template
    `from_pretrained` would give it (the folder's processor template; the tokenizer's only if the
    folder has none)."""
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        Qwen3OmniMoeProcessor,
    )

    processor_class = Qwen2_5OmniProcessor if family_of(folder) is Family.QWEN2_5_OMNI else Qwen3OmniMoeProcessor

    class ProcessorWithoutVideo(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":  # VIDEO_PROCESSOR_MAPPING is a dummy without torchvision
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    image_processor = AutoImageProcessor.from_pretrained(str(folder))
    processor_dict, _ = processor_class.get_processor_dict(str(folder))
    template = processor_dict.get("chat_template") or tokenizer.chat_template
    return ProcessorWithoutVideo(
        image_processor=image_processor, video_processor=NoVideo(image_processor.merge_size),
        feature_extractor=AutoFeatureExtractor.from_pretrained(str(folder)), tokenizer=tokenizer,
        chat_template=template,
    )


def oracle_audio(data: bytes, field_name: str) -> np.ndarray:
    """wav/flac bytes -> mono float32 samples at 16 kHz (soundfile; no resampling)."""
    import soundfile as sf

    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises several types for garbage input
        raise InvalidArgument(field_name, f"not a readable wav/flac file ({type(exc).__name__})") from None
    if rate != AUDIO_SAMPLE_RATE:
        raise InvalidArgument(field_name, f"the reference takes {AUDIO_SAMPLE_RATE} Hz audio only, got {rate} Hz")
    return samples.mean(axis=1)


def oracle_conversation(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages -> the conversation format of transformers' processors (content blocks of
    type text, audio (samples), image (PIL))."""
    from PIL import Image

    conversation = []
    for i, message in enumerate(messages):
        content = []
        for j, part in enumerate(message.parts):
            if part.text is not None:
                content.append({"type": "text", "text": part.text})
            elif part.audio is not None:
                content.append({"type": "audio", "audio": oracle_audio(part.audio, f"messages[{i}].content[{j}].audio")})
            elif part.image is not None:
                content.append({"type": "image", "image": Image.open(io.BytesIO(part.image))})
        conversation.append({"role": message.role.value, "content": content})
    return conversation


def oracle_inputs(processor, messages: list[ChatMessage]) -> dict:
    """The model inputs `processor` (`oracle_processor`) makes of the messages: input_ids,
    attention_mask, and input_features / feature_attention_mask, pixel_values / image_grid_thw when
    present."""
    if not messages:
        raise InvalidArgument("messages", "at least one message is required")
    out = processor.apply_chat_template(oracle_conversation(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=True, return_tensors="pt")
    return dict(out)


class ReferenceRunner:
    """The full transformers model, loaded once; one greedy `generate` per call."""

    def __init__(self, checkpoint: str | Path, device: str = "cpu", dtype: str = "float32", gemm: bool = False):
        """`gemm`: every float32 linear layer and MoE expert of `generate` through omni's invariant
        GEMM, as a pipeline with `--exact-batching gemm` runs them: the oracle for that mode (its
        bits are not MKL's, so plain `generate` is not)."""
        import torch
        import transformers
        from transformers import Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration

        folder = check_folder(checkpoint)
        self.family = family_of(folder)
        model_class = {Family.QWEN3_OMNI: Qwen3OmniMoeForConditionalGeneration,
                       Family.QWEN2_5_OMNI: Qwen2_5OmniForConditionalGeneration}[self.family]
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            # Loaded in `dtype` directly: a 30B checkpoint does not fit host memory as float32.
            # (Qwen2.5-Omni's from_pretrained also loads spk_dict.pt; its generate keeps Token2Wav float32.)
            self.model = model_class.from_pretrained(str(folder), dtype=getattr(torch, dtype))
            self.processor = oracle_processor(folder)
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.model.to(device).eval()
        if gemm:
            self._through_invariant_gemm()
        self.device = device
        self.folder = folder
        self.config = self.model.config
        if self.family is Family.QWEN2_5_OMNI:
            self.voices = {name.lower(): name for name in self.model.speaker_map}  # lower-case -> spk_dict name
            self.eos_id = self.config.thinker_config.eos_token_id
            if self.eos_id is None:
                self.eos_id = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        else:
            # transformers bug: audio + image in one prompt fails in the talker without this
            # (docs/qwen3-omni.md, section "transformers quirks").
            if not hasattr(self.config.talker_config, "audio_config"):
                self.config.talker_config.audio_config = self.config.thinker_config.audio_config
            self.voices = {name: name for name in self.config.talker_config.speaker_id}
            self.eos_id = self.config.im_end_token_id
        self.sample_rate = SPEECH_SAMPLE_RATE

    def _through_invariant_gemm(self) -> None:
        # The attention the engines run with --exact-batching gemm: the thinker's and the talker's.
        talker = self.model.config.talker_config
        use_invariant_attention(self.model.config.thinker_config.text_config,
                                talker.text_config if self.family is Family.QWEN3_OMNI else talker)

        # The experts' own configs only: setting a composite config's implementation reaches its sub-configs.
        use_exact_experts(*{id(m.config): m.config for m in experts_modules(self.model)}.values())
        use_exact_rotary(self.model)  # cos and sin through the invariant kernels' scalar form too
        plain = self.model.generate

        def generate(*args, **kwargs):
            with using_kernels(GEMM_KERNELS):
                return plain(*args, **kwargs)

        self.model.generate = generate

    def generate(
        self,
        messages: list[ChatMessage],
        voice: str | None = None,
        max_new_tokens: int = 64,
        talker_max_new_tokens: int = 256,
        return_audio: bool = True,
        forced_ids: list[int] | None = None,
        thinker_sampling: dict | None = None,
        talker_sampling: dict | None = None,
        seed: int | None = None,
        inputs: dict | None = None,
    ) -> ReferenceResult:
        """Greedy unless `thinker_sampling` / `talker_sampling` (generate's temperature, top_k, top_p,
        repetition_penalty) are given: then that stage samples, from torch's global generator seeded
        with `seed` just before generate. `forced_ids`: make the thinker produce exactly these ids
        (text-to-speech oracle): a logits processor leaves only the next forced id finite at each
        step, so greedy `generate` picks it and the rest of `generate` (hidden states, talker,
        vocoder) runs unchanged on that output. `inputs`: processor inputs made elsewhere (the video
        oracle, services/tools/video_oracle.py; `use_audio_in_video` among them), in place of the messages'."""
        name = self.speaker(voice)
        inputs = self.inputs(messages) if inputs is None else inputs
        prompt_tokens = int(inputs["input_ids"].shape[1])
        kwargs = _sampling_kwargs(thinker_sampling, talker_sampling)
        if forced_ids:
            from transformers import LogitsProcessorList

            kwargs["thinker_logits_processor"] = LogitsProcessorList([_ForceIds(forced_ids, prompt_tokens)])
            max_new_tokens = len(forced_ids)
        kwargs.update(thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=self.eos_id)
        if return_audio:
            kwargs["talker_max_new_tokens"] = talker_max_new_tokens
        else:
            kwargs = {k: v for k, v in kwargs.items() if k.startswith("thinker_")}
        run = self._generate_qwen2_5 if self.family is Family.QWEN2_5_OMNI else self._generate_qwen3
        model_inputs = self.model_inputs(inputs)  # on the model's device before the clock starts, as before
        start = time.perf_counter()
        sequences, wav, frames = run(model_inputs, name, return_audio, kwargs, seed)
        wall = time.perf_counter() - start
        ids = sequences[0, prompt_tokens:].cpu().tolist()
        audio = wav.reshape(-1).float().cpu().numpy() if wav is not None else np.zeros(0, np.float32)
        return ReferenceResult(
            text=self.decode(ids), thinker_token_ids=ids, codec_frames=frames, audio=audio,
            sample_rate=self.sample_rate, prompt_tokens=prompt_tokens, wall_s=wall,
        )

    def _generate_qwen3(self, model_inputs: dict, speaker: str, return_audio: bool, kwargs: dict,
                        seed: int | None) -> tuple:
        """Qwen3-Omni's `generate`; the codes are those generate hands to the vocoder's
        `chunked_decode` ([1, Q, frames]). (sequences, waveform or None, frames)"""
        import torch

        if seed is not None:
            torch.manual_seed(seed)
        if not return_audio:
            with torch.inference_mode():
                return self.model.generate(**model_inputs, return_audio=False, **kwargs), None, []
        captured = []  # [1, Q, frames]
        original = self.model.code2wav.chunked_decode

        def capture(codes, *args, **kw):
            captured.append(codes.detach().clone())
            return original(codes, *args, **kw)

        self.model.code2wav.chunked_decode = capture
        try:
            with torch.inference_mode():
                sequences, wav = self.model.generate(**model_inputs, speaker=speaker, return_audio=True, **kwargs)
        finally:
            del self.model.code2wav.chunked_decode
        return sequences, wav, captured[0][0].T.tolist() if captured else []

    def _generate_qwen2_5(self, model_inputs: dict, speaker: str, return_audio: bool, kwargs: dict,
                          seed: int | None) -> tuple:
        """Qwen2.5-Omni's `generate`. Greedy is do_sample=False for both LMs, with generate's other
        talker defaults kept (repetition penalty 1.05); the codes come from a forward pre-hook on
        Token2Wav, which gets them after generate's cut at the first codec EOS ([1, codes]); its
        diffusion noise comes from torch's global generator, seeded here. (sequences, waveform or None, frames)"""
        import torch

        captured = []  # [1, codes]
        hook = self.model.token2wav.register_forward_pre_hook(
            lambda module, args, kw: captured.append(args[0].detach().clone()), with_kwargs=True)
        torch.manual_seed(TOKEN2WAV_SEED if seed is None else seed)
        try:
            with torch.inference_mode():
                if return_audio:
                    sequences, wav = self.model.generate(**model_inputs, speaker=speaker, **kwargs)
                else:
                    sequences = self.model.generate(**model_inputs, speaker=speaker, generation_mode="text", **kwargs)
                    wav = None
        finally:
            hook.remove()
        return sequences, wav, [[code] for code in captured[0][0].tolist()] if captured else []

    def inputs(self, messages: list[ChatMessage]) -> dict:
        """The model inputs transformers' processor makes of the messages (`oracle_inputs`)."""
        return oracle_inputs(self.processor, messages)

    def speaker(self, voice: str | None) -> str:
        """The `speaker` generate takes for a voice name, matched case-insensitively; None: the
        family's default (families.DEFAULT_VOICES, as the pipeline picks it), else the first voice."""
        if voice is None:
            return self.voices.get(DEFAULT_VOICES[self.family].lower(), next(iter(self.voices.values())))
        if voice.lower() not in self.voices:
            known = ", ".join(sorted(self.voices.values()))
            raise InvalidArgument("voice", f"unknown voice {voice!r}; known: {known}")
        return self.voices[voice.lower()]

    def model_inputs(self, inputs: dict) -> dict:
        """Processor inputs (one request's, or a collated batch) as this family's generate takes
        them, on the model's device."""
        inputs = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in inputs.items()}
        if self.family is Family.QWEN2_5_OMNI:
            # transformers quirk: generate hands unprefixed pixel_values to the talker too, whose generate
            # rejects them (ValueError: model_kwargs not used); prefixed, they reach the thinker alone, and
            # generate still zeroes the image positions it hands the talker (it reads thinker_kwargs).
            inputs = {(f"thinker_{k}" if k in ("pixel_values", "pixel_values_videos") else k): v
                      for k, v in inputs.items()}
        return inputs

    def generate_greedy(self, model_inputs: dict, speaker: str, max_new_tokens: int,
                        talker_max_new_tokens: int) -> tuple:
        """Greedy text + audio `generate` on `model_inputs` (`model_inputs`; a left-padded batch
        works too), with generate's other talker defaults (repetition penalty 1.05) and nothing
        captured: what the benchmark times. (sequences [B, P + new], [B] waveforms [samples_b] each,
        every one cut at its own end.)"""
        import torch

        audio_flag = {"generation_mode": "audio"} if self.family is Family.QWEN2_5_OMNI else {"return_audio": True}
        with torch.inference_mode():
            sequences, wav = self.model.generate(
                **model_inputs, speaker=speaker, **audio_flag, thinker_max_new_tokens=max_new_tokens,
                thinker_eos_token_id=self.eos_id, thinker_do_sample=False,
                talker_max_new_tokens=talker_max_new_tokens, talker_do_sample=False,
            )
        # One request: one waveform ([1, 1, samples] for Qwen3-Omni, [samples] for Qwen2.5-Omni); a batch: a list.
        wavs = [wav.reshape(-1)] if sequences.shape[0] == 1 else [w.reshape(-1) for w in wav]
        return sequences, wavs

    def decode(self, ids: list[int]) -> str:
        return self.processor.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _sampling_kwargs(thinker: dict | None, talker: dict | None) -> dict:
    """generate's sampling keywords: a stage samples when its settings are given, else is greedy."""
    kwargs = {f"thinker_{k}": v for k, v in (thinker or {}).items()}
    kwargs.update({f"talker_{k}": v for k, v in (talker or {}).items()})
    kwargs.update(thinker_do_sample=thinker is not None, talker_do_sample=talker is not None)
    return kwargs


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
    parser.add_argument("--exact-batching", choices=["on", "gemm"], default="on",
                        help="gemm: run generate through omni's invariant GEMM, the oracle of a pipeline with "
                             "--exact-batching gemm (default on: plain transformers)")
    args = parser.parse_args(argv)

    def run() -> None:
        messages = messages_from_args(args.prompt, args.system, args.audio, args.image)  # files first
        runner = ReferenceRunner(args.checkpoint, gemm=args.exact_batching == "gemm")
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
