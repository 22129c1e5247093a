"""Turn chat messages (text, audio bytes, image bytes) into the thinker's model inputs.

Both families (services/base/families.py) render their chat template and expand placeholders
alike; what differs is how audio becomes features and prompt tokens (`AudioRules`, with the media
decoding in services/runtime/inputs/media.py). Images are the same Qwen2-VL processor and
`grid.prod() // merge_size**2` tokens in both.

`Qwen3OmniMoeProcessor` insists on a video processor, which needs torchvision (not importable
beside the CPU torch wheel), so this drives the checkpoint's tokenizer, Whisper feature
extractor and Qwen2-VL image processor directly, exactly as the processor does for audio and
images: render the chat template, then expand each audio/image placeholder to one token per
encoder output position. The reference runner does not use this code: it builds its inputs with
transformers' own processor (services/tools/reference.py), and tests/e2e/test_independent_oracle.py
checks that both give identical inputs.
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.base.errors import ContextFull, InvalidArgument
from services.base.families import DEFAULT_VOICES, Family
from services.base.resample import resample
from services.runtime.inputs.limits import (
    AudioHeader,
    check_image_size,
    declared_audio,
    declared_image_size,
    max_token_bytes,
    text_byte_limit,
)
from services.runtime.inputs.media import AUDIO_SAMPLE_RATE, MEL_HOP, Media, audio_rules, decode_audio, decode_image
from services.runtime.inputs.video import (
    VideoHeader,
    VideoLimits,
    declared_frames,
    declared_video,
    decode_video,
    sample_indices,
    video_from_frames,
    video_grid,
    video_rules,
    video_tokens,
)

if TYPE_CHECKING:
    import torch


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result, answering the assistant's call `tool_call_id`


@dataclass(frozen=True)
class Part:
    text: str | None = None
    audio: bytes | None = None  # wav/flac file bytes
    image: bytes | None = None  # png/jpeg file bytes
    video: bytes | None = None  # mp4/webm file bytes
    video_frames: tuple[bytes, ...] | None = None  # a video as png/jpeg frames, taken at video_fps a second
    video_fps: float = 0.0
    # With a video: its audio track is heard too, interleaved by time (transformers'
    # `use_audio_in_video`, one value for every video of a prompt).
    use_audio_in_video: bool = False


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    parts: tuple[Part, ...]
    # An assistant turn's calls as the chat template takes them: {"id", "type": "function",
    # "function": {"name", "arguments"}} (arguments a dict when they are a JSON object).
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str | None = None  # Role.TOOL: the call it answers


@dataclass
class PromptInputs:
    input_ids: torch.Tensor  # [1, P] int64
    attention_mask: torch.Tensor  # [1, P] int64
    # Only present with audio: [n_audio, 128, T] mel features and [n_audio, T] mask.
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    # Only present with images: [patches, C*t*p*p] and [n_images, 3] (t, h, w in patches).
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # Only present with videos: [patches, C*t*p*p], [n_videos, 3] and [n_videos] (seconds a temporal patch).
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    use_audio_in_video: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict:
        """The keyword arguments the thinker's forward / generate take."""
        kw = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.input_features is not None:
            kw["input_features"] = self.input_features
            kw["feature_attention_mask"] = self.feature_attention_mask
        if self.pixel_values is not None:
            kw["pixel_values"] = self.pixel_values
            kw["image_grid_thw"] = self.image_grid_thw
        if self.pixel_values_videos is not None:
            kw["pixel_values_videos"] = self.pixel_values_videos
            kw["video_grid_thw"] = self.video_grid_thw
            kw["video_second_per_grid"] = self.video_second_per_grid
            if self.use_audio_in_video:
                kw["use_audio_in_video"] = True
        return kw

    @property
    def audio_feature_lengths(self) -> torch.Tensor | None:
        if self.feature_attention_mask is None:
            return None
        return self.feature_attention_mask.sum(-1)



@dataclass(frozen=True)
class ClipFeatures:
    """One audio part's log-mel features [mel, frames] and frame mask [frames], computed alone
    (PromptBuilder.feature_cache's entries)."""
    values: torch.Tensor
    mask: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.mask))


FEATURES = "audio_features"  # the feature cache's entries: their key's and their counters' name


@dataclass(frozen=True)
class PromptLimits:
    """What one request may carry; beyond them INVALID_ARGUMENT naming the field."""

    max_prompt_tokens: int | None = None  # None: the model's max_position_embeddings
    max_audio_seconds: float = 300.0  # per audio part
    max_image_pixels: int = 4096 * 4096  # per image part, before resizing
    video: VideoLimits = VideoLimits()  # per video part, as its header declares
    video_fps: float = 2.0  # frames sampled per second of video (Qwen's own default)



class PromptBuilder:
    """Loads the checkpoint's tokenizer and processors once; builds inputs per request."""

    def __init__(self, folder: str | Path, config, limits: PromptLimits = PromptLimits()):
        from transformers import (
            AutoFeatureExtractor,
            AutoImageProcessor,
            AutoTokenizer,
            Qwen2_5OmniProcessor,
            Qwen3OmniMoeProcessor,
        )

        self.folder = str(folder)
        self.family = Family(config.model_type)
        processor_cls = Qwen2_5OmniProcessor if self.family is Family.QWEN2_5_OMNI else Qwen3OmniMoeProcessor

        # Fast tokenizers are not safe to share between threads (RuntimeError: Already borrowed).
        # Prompts are encoded in worker threads, deltas decoded on the event loop: each side has
        # a tokenizer (and a lock) of its own, so a long prompt never holds up another stream's
        # output (or anything else on the event loop, health checks included).
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        # The processor's chat template (chat_template.jinja, or the legacy chat_template.json) wins over
        # the tokenizer's, as in transformers' processor: a checkpoint may carry only that one.
        processor_dict, _ = processor_cls.get_processor_dict(str(folder))
        template = processor_dict.get("chat_template")
        template = template.get("default") if isinstance(template, dict) else template
        self.chat_template = template or self.tokenizer.chat_template
        self._encode_lock = threading.Lock()
        self._decoder = AutoTokenizer.from_pretrained(str(folder))
        self._decode_lock = threading.Lock()
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(str(folder))
        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        self.config = config
        self.audio_token = getattr(self.tokenizer, "audio_token", None) or "<|audio_pad|>"
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(self.tokenizer, "video_token", None) or "<|video_pad|>"
        self.placeholders = (self.audio_token, self.image_token, self.video_token)
        self.vision_bos = getattr(self.tokenizer, "vision_bos_token", None) or "<|vision_start|>"
        self.vision_eos = getattr(self.tokenizer, "vision_eos_token", None) or "<|vision_end|>"
        self.audio_bos = getattr(self.tokenizer, "audio_bos_token", None) or "<|audio_start|>"
        self.audio_eos = getattr(self.tokenizer, "audio_eos_token", None) or "<|audio_end|>"
        # PyAV maps ~35 MB of FFmpeg libraries: at start-up, not in the first video request. The
        # video processor's config (transformers' loader: video_preprocessor_config.json, else
        # preprocessor_config.json) under the omni processor's own video defaults.
        import av  # noqa: F401
        from transformers.video_processing_utils import BaseVideoProcessor

        self._video_dict, _ = BaseVideoProcessor.get_video_processor_dict(str(folder))
        self._video_defaults = processor_cls.valid_processor_kwargs._defaults["videos_kwargs"]
        self.audio_rules = audio_rules(self.family, config, self.feature_extractor)
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        # The thinker's encoder cache when it is on (services/thinker/encoder_cache.py): each audio
        # part's features are then computed alone and kept by content (`_audio_features`).
        self.feature_cache = None
        self._set_limits(limits)

    def _set_limits(self, limits: PromptLimits) -> None:
        model_max = self.config.thinker_config.text_config.max_position_embeddings
        self.max_prompt_tokens = min(limits.max_prompt_tokens or model_max, model_max)
        self.limits = limits
        # Text beyond this cannot fit the prompt limit: refused before it is tokenized.
        self.max_text_bytes = text_byte_limit(self.max_prompt_tokens, self.max_token_bytes)
        self.video_rules = video_rules(self._video_dict, self._video_defaults, limits.video_fps)

    def with_limits(self, limits: PromptLimits) -> PromptBuilder:
        """The same tokenizer and processors under other limits (no reloading)."""
        import copy

        other = copy.copy(self)
        other._set_limits(limits)
        return other

    def audio_tokens_at_least(self, header: AudioHeader) -> int:
        """Prompt tokens an audio part of this header yields, at least (whole encoder chunks)."""
        mel_frames = header.frames * AUDIO_SAMPLE_RATE // header.rate // MEL_HOP
        return self.audio_rules.at_least(mel_frames)

    def image_tokens(self, width: int, height: int) -> int:
        """Prompt tokens of an image this size (Qwen2-VL's resize: patches / merge^2)."""
        p = self.image_processor
        factor = p.patch_size * p.merge_size
        size = getattr(p, "size", None)
        min_pixels = getattr(p, "min_pixels", None) or getattr(size, "shortest_edge", None) or factor * factor
        max_pixels = getattr(p, "max_pixels", None) or getattr(size, "longest_edge", None)
        if max_pixels is None:  # a processor of another layout: count the least, one token
            return 1
        h = max(factor, round(height / factor) * factor)
        w = max(factor, round(width / factor) * factor)
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return max(1, (h // p.patch_size) * (w // p.patch_size) // (p.merge_size ** 2))

    def _check_declared(self, messages: list[ChatMessage], field_prefix: str) -> dict:
        """Check every part's header against the limits and the prompt's least token count
        against the prompt limit, before anything is decoded or tokenized; part -> its header."""
        headers = {}
        text_bytes, at_least = 0, 0
        for i, message in enumerate(messages):
            for j, part in enumerate(message.parts):
                where = f"{field_prefix}[{i}].content[{j}]"
                if part.text is not None:
                    text_bytes += len(part.text.encode("utf-8", "surrogatepass"))
                elif part.audio is not None:
                    header = declared_audio(part.audio, f"{where}.audio", self.limits.max_audio_seconds)
                    headers[(i, j)] = header
                    at_least += self.audio_tokens_at_least(header)
                elif part.image is not None:
                    width, height = declared_image_size(part.image, f"{where}.image")
                    check_image_size(width, height, f"{where}.image", self.limits.max_image_pixels)
                    at_least += self.image_tokens(width, height)
                elif part.video is not None or part.video_frames is not None:
                    field_name = f"{where}.video" if part.video is not None else f"{where}.video_frames"
                    header = self._declared_video(part, field_name)
                    headers[(i, j)] = header
                    at_least += video_tokens(self.video_rules, video_grid(self.video_rules, header, field_name))
                    if header.audio is not None:
                        frames = int(header.audio.seconds * AUDIO_SAMPLE_RATE) // MEL_HOP
                        at_least += self.audio_rules.at_least(frames)
        if text_bytes > self.max_text_bytes:
            raise InvalidArgument(field_prefix, f"prompt text is {text_bytes} bytes, more than the {self.max_text_bytes} "
                                                f"that {self.max_prompt_tokens} tokens can hold (the limit)")
        at_least += -(-text_bytes // self.max_token_bytes)
        if at_least > self.max_prompt_tokens:  # a shorter history would fit: ContextFull (a session truncates)
            raise ContextFull(field_prefix, f"prompt is at least {at_least} tokens, longer than the limit of "
                                                f"{self.max_prompt_tokens}")
        return headers

    def _declared_video(self, part: Part, field_name: str) -> VideoHeader:
        if part.video_frames is not None:
            return declared_frames(part.video_frames, part.video_fps, field_name, self.limits.video,
                                   part.use_audio_in_video)
        header = declared_video(part.video, field_name, self.limits.video, with_audio=part.use_audio_in_video)
        if header.audio is not None and header.audio.seconds > self.limits.max_audio_seconds:
            raise InvalidArgument(field_name, f"the audio track is {header.audio.seconds:.1f} s, longer than "
                                              f"{self.limits.max_audio_seconds} s")
        return header

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (Qwen3-Omni's does, Qwen2.5-Omni's not)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def build(self, messages: list[ChatMessage], field_prefix: str = "messages", tools: list[dict] | None = None,
              reply_prefix: str = "") -> PromptInputs:
        """The thinker's inputs for a chat: every declared size checked before anything is
        decoded, then the media decoded, the chat template applied (with `tools`, the function
        definitions it renders, as transformers' `apply_chat_template(tools=...)`; then
        `reply_prefix`, the start of the reply the model goes on from), the media placeholders
        expanded and the text tokenized."""
        import torch

        use_audio_in_video = self._check_messages(messages, field_prefix)
        headers = self._check_declared(messages, field_prefix)
        media = Media()
        chat = []
        for i, message in enumerate(messages):
            turn = {"role": message.role.value,
                    "content": [self._decode_part(part, f"{field_prefix}[{i}].content[{j}]", headers.get((i, j)), media,
                                                  use_audio_in_video)
                                for j, part in enumerate(message.parts)]}
            if message.tool_calls:
                turn["tool_calls"] = list(message.tool_calls)
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            chat.append(turn)
        with self._encode_lock:
            text = self.tokenizer.apply_chat_template(chat, chat_template=self.chat_template, tools=tools or None,
                                                      add_generation_prompt=True, tokenize=False)
        text += reply_prefix
        inputs, audio_counts, image_counts = self._media_inputs(media, use_audio_in_video)
        text = self._expand_media(text, audio_counts, image_counts, [v.grid for v in media.videos], use_audio_in_video)
        with self._encode_lock:
            ids = self.tokenizer(text, return_tensors="pt")["input_ids"].to(torch.long)
        if ids.shape[1] > self.max_prompt_tokens:
            raise ContextFull(
                field_prefix, f"prompt is {ids.shape[1]} tokens, longer than the limit of {self.max_prompt_tokens}"
            )
        return PromptInputs(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs)

    @staticmethod
    def _check_messages(messages: list[ChatMessage], field_prefix: str) -> bool:
        """The chat's shape (a user message, no empty message, one `use_audio_in_video` for
        every video); returns that setting."""
        if not messages:
            raise InvalidArgument(field_prefix, "at least one message is required")
        for i, message in enumerate(messages):
            if not message.parts and not message.tool_calls:
                raise InvalidArgument(f"{field_prefix}[{i}].content", "a message needs at least one part")
        if not any(m.role is Role.USER for m in messages):
            raise InvalidArgument(field_prefix, "at least one user message is required")
        with_audio = {p.use_audio_in_video for m in messages for p in m.parts
                      if p.video is not None or p.video_frames is not None}
        if len(with_audio) > 1:
            raise InvalidArgument("use_audio_in_video", "applies to every video of a prompt or to none")
        return with_audio == {True}

    def check_text(self, text: str, where: str) -> None:
        """Text of the prompt holds no media placeholder (it would be expanded, or left, as media
        positions)."""
        for token in self.placeholders:
            if token in text:
                raise InvalidArgument(where, f"contains the reserved token {token}")

    def _decode_part(self, part: Part, where: str, header, media: Media, use_audio_in_video: bool) -> dict:
        """One content part decoded into `media` (header: its declared size, checked already);
        returns its entry in the chat template's content."""
        if part.text is not None:
            self.check_text(part.text, f"{where}.text")
            return {"type": "text", "text": part.text}
        if part.audio is not None:
            media.audios.append(decode_audio(part.audio, f"{where}.audio", self.limits.max_audio_seconds, header))
            media.audio_fields.append(f"{where}.audio")
            return {"type": "audio"}
        if part.image is not None:
            media.images.append(decode_image(part.image, f"{where}.image", self.limits.max_image_pixels))
            return {"type": "image"}
        if part.video is not None:
            video = decode_video(part.video, f"{where}.video", header, self.video_rules, with_audio=use_audio_in_video)
            media.videos.append(video)
            if video.audio is not None:  # in prompt order among the audio parts, as the processor takes them
                media.audios.append(resample(video.audio, video.audio_rate, AUDIO_SAMPLE_RATE))
                media.audio_fields.append(f"{where}.video")
            return {"type": "video"}
        if part.video_frames is not None:
            field_name = f"{where}.video_frames"
            frames = [np.asarray(decode_image(part.video_frames[k], f"{field_name}[{k}]", self.limits.video.max_pixels))
                      for k in sample_indices(self.video_rules, header, field_name)]
            media.videos.append(video_from_frames(frames, self.video_rules))
            return {"type": "video"}
        raise InvalidArgument(where, "empty content part")


    def _media_inputs(self, media: Media, use_audio_in_video: bool) -> tuple[dict, list[int], list[int]]:
        """The processors' tensors for the decoded media, and the placeholder count of each audio
        and image."""
        import torch

        inputs = {}
        audio_counts, image_counts = [], []
        if media.audios:
            longest = max(len(samples) for samples in media.audios)
            if longest < self.audio_rules.min_samples:
                least = self.audio_rules.min_samples
                raise InvalidArgument(media.audio_fields[0], f"audio is {len(media.audios[0])} samples at "
                                      f"{AUDIO_SAMPLE_RATE} Hz; the longest audio of a prompt needs at least {least} "
                                      f"({1000 * least / AUDIO_SAMPLE_RATE:.1f} ms)")
            feats = self._audio_features(media.audios, longest)
            inputs["input_features"] = feats["input_features"]
            inputs["feature_attention_mask"] = feats["attention_mask"]
            audio_counts = [int(n) for n in self.audio_rules.tokens(feats["attention_mask"].sum(-1).numpy())]
        if media.images:
            pix = self.image_processor(images=media.images, return_tensors="pt")
            inputs["pixel_values"] = pix["pixel_values"]
            inputs["image_grid_thw"] = pix["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            image_counts = [int(g.prod()) // merge for g in pix["image_grid_thw"]]
        if videos := media.videos:
            # One video: its patches as they are (a cat would hold a second copy at the peak).
            inputs["pixel_values_videos"] = (videos[0].pixel_values if len(videos) == 1
                                             else torch.cat([v.pixel_values for v in videos]))
            for v in videos:
                v.pixel_values = None
            inputs["video_grid_thw"] = torch.tensor([v.grid for v in videos])
            inputs["video_second_per_grid"] = torch.tensor([self.video_rules.second_per_grid] * len(videos))
            inputs["use_audio_in_video"] = use_audio_in_video
        return inputs, audio_counts, image_counts

    def _audio_features(self, audios: list[np.ndarray], longest: int) -> dict:
        """The extractor's features and masks of a prompt's audio parts: its one call over them all
        (the processor's, generate's bits), or, with `feature_cache`, each part alone, padded as that
        call pads it (to the prompt's longest, or the family's window) and kept by its samples and
        that length. A part's features are then a function of the two alone, so a kept entry is the
        bits computing it again gives; the call over all parts measured the same bits, but its STFT
        and mel product run batched (as with the encoders, services/thinker/encoder_cache.py's NOTE,
        nothing promises a row's bits beside others). A voice session re-sends every clip of its
        history each turn: 79 ms of features at 38 clips, 2 ms for the new one alone."""
        import torch

        kwargs = {"sampling_rate": AUDIO_SAMPLE_RATE, "return_attention_mask": True, "return_tensors": "pt",
                  **self.audio_rules.feature_kwargs}
        cache = self.feature_cache
        if cache is None:
            return self.feature_extractor(audios, **kwargs)
        if kwargs.get("padding") is True:  # to the longest part: the same padding, asked for each part
            kwargs |= {"padding": "max_length", "max_length": longest}
        rows = []
        for samples in audios:
            key = cache.key(FEATURES, torch.from_numpy(np.ascontiguousarray(samples)), torch.tensor([longest]))
            found = cache.get(FEATURES, key)
            if found is None:
                one = self.feature_extractor([samples], **kwargs)
                found = ClipFeatures(one["input_features"][0], one["attention_mask"][0])
                cache.put(key, found)
            rows.append(found)
        return {"input_features": torch.stack([r.values for r in rows]),
                "attention_mask": torch.stack([r.mask for r in rows])}

    def _expand_media(self, text: str, audio_counts: list[int], image_counts: list[int],
                      video_grids: list[tuple[int, int, int]], use_audio_in_video: bool) -> str:
        """Each placeholder, left to right, as one pad per encoder position. Audio counts are in
        prompt order over audio parts and (with use_audio_in_video) video tracks alike; a video
        with its track becomes audio-bos, the video and audio pads interleaved by time, audio-eos
        (inside the template's vision-bos / vision-eos)."""
        import re

        audio, image, video = iter(audio_counts), iter(image_counts), iter(video_grids)
        pattern = "|".join(re.escape(t) for t in self.placeholders)
        out, last = [], 0
        for match in re.finditer(pattern, text):
            out.append(text[last:match.start()])
            last = match.end()
            token = match.group()
            if token == self.audio_token:
                out.append(token * next(audio))
            elif token == self.image_token:
                out.append(token * next(image))
            elif not use_audio_in_video:
                out.append(token * video_tokens(self.video_rules, next(video)))
            else:
                out.append(self.audio_bos + self._interleave(next(video), next(audio)) + self.audio_eos)
        out.append(text[last:])
        assert next(audio, None) is None and next(image, None) is None and next(video, None) is None
        return "".join(out)

    def _interleave(self, grid: tuple[int, int, int], n_audio: int) -> str:
        """A video's pads and its track's pads in time order (the family's processor rule)."""
        rules = self.video_rules
        t, h, w = grid
        per_grid = (h // rules.merge_size) * (w // rules.merge_size)
        times = np.repeat(np.arange(t), per_grid) * rules.second_per_grid * rules.position_id_per_seconds
        v, a = self.video_token, self.audio_token
        if self.family is Family.QWEN2_5_OMNI:
            # Chunks of seconds_per_chunk: each chunk's video pads, then its audio pads.
            per_chunk = int(rules.position_id_per_seconds * rules.seconds_per_chunk)
            video_chunks = _chunks(times, per_chunk)
            audio_chunks = _chunks(np.arange(n_audio), per_chunk)
            pieces = []
            for k in range(max(len(video_chunks), len(audio_chunks))):
                if k < len(video_chunks):
                    pieces.append(v * video_chunks[k])
                if k < len(audio_chunks):
                    pieces.append(a * audio_chunks[k])
            return "".join(pieces)
        # Qwen3-Omni: merge by time, a video pad first when its time is not after the audio pad's.
        pieces, i, j = [], 0, 0
        while i < len(times) and j < n_audio:
            if times[i] <= j:
                pieces.append(v)
                i += 1
            else:
                pieces.append(a)
                j += 1
        return "".join(pieces) + v * (len(times) - i) + a * (n_audio - j)

    def encode_text(self, text: str) -> list[int]:
        """Plain text -> token ids, no special tokens added (a reply's content)."""
        with self._encode_lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self._decode_lock:
            return self._decoder.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _chunks(times: np.ndarray, per_chunk: int) -> list[int]:
    """Qwen2.5-Omni's chunking of increasing time positions: the size of each chunk, a chunk ending
    where a time reaches the next multiple of per_chunk (one chunk boundary per position at most)."""
    sizes, start, chunk = [], 0, 1
    for i, value in enumerate(times):
        if value >= chunk * per_chunk:
            sizes.append(i - start)
            start = i
            chunk += 1
    sizes.append(len(times) - start)
    return sizes


def speaker_names(config) -> list[str]:
    return list(config.talker_config.speaker_id.keys())


def default_voice(config) -> str:
    names = speaker_names(config)
    default = DEFAULT_VOICES[Family.QWEN3_OMNI]
    return default if default in names else names[0]


def resolve_voice(config, voice: str | None, field_name: str = "voice") -> tuple[str, int]:
    """A voice name (case-insensitive; None = default) -> (name, codec speaker id)."""
    name = (voice or default_voice(config)).lower()
    ids = config.talker_config.speaker_id
    if name not in ids:
        raise InvalidArgument(field_name, f"unknown voice {voice!r}; known: {', '.join(sorted(ids))}")
    return name, int(ids[name])
