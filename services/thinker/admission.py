"""A thinker request's admission, in one place: what the request asks (`wants_audio`), its messages
(`messages_from_proto`) and prompt, its sampling against this stage's limits and the talker's, the
forced reply of a text-to-speech request, its prefix-cache keys (`prompt_prefix`): checked and
converted before any work, each refusal an InvalidArgument naming the field. `Admission.prepare`
runs in a worker thread (it decodes audio, images and video); the stream (stream.py `admit`) asks
the talker replica's limits first."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omni.v1 import common_pb2, omni_pb2
from services.base.errors import InvalidArgument
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.prefix.keys import PromptPrefix
from services.serving.convert import sampling_from_proto
from services.serving.prefix_keys import media_digests, message_keys
from services.thinker.adapter import ThinkerAdapter
from services.thinker.config import Backend, ThinkerConfig
from services.thinker.engine import ThinkerJob

_ROLES = {omni_pb2.ROLE_SYSTEM: Role.SYSTEM, omni_pb2.ROLE_USER: Role.USER, omni_pb2.ROLE_ASSISTANT: Role.ASSISTANT}


def wants_audio(request: omni_pb2.GenerateRequest) -> bool:
    modalities = set(request.output_modalities)
    if not modalities:
        return True
    if modalities - {omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO}:
        raise InvalidArgument("output_modalities", "only MODALITY_TEXT and MODALITY_AUDIO exist")
    if omni_pb2.MODALITY_TEXT not in modalities:
        raise InvalidArgument("output_modalities", "text is always produced: use [TEXT] or [TEXT, AUDIO]")
    return omni_pb2.MODALITY_AUDIO in modalities


@dataclass(frozen=True)
class Prepared:
    job: ThinkerJob
    audio: bool


def messages_from_proto(request: omni_pb2.GenerateRequest) -> list[ChatMessage]:
    messages = []
    for i, message in enumerate(request.messages):
        if message.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role", "must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
        parts = []
        for j, content in enumerate(message.content):
            kind = content.WhichOneof("part")
            if kind is None:
                raise InvalidArgument(f"messages[{i}].content[{j}]", "empty content part")
            if kind == "video":
                parts.append(Part(video=content.video, use_audio_in_video=request.use_audio_in_video))
            elif kind == "video_frames":
                parts.append(Part(video_frames=tuple(content.video_frames.frames), video_fps=content.video_frames.fps,
                                  use_audio_in_video=request.use_audio_in_video))
            else:
                parts.append(Part(**{kind: getattr(content, kind)}))
        messages.append(ChatMessage(_ROLES[message.role], tuple(parts)))
    return messages


def prompt_prefix(request: omni_pb2.GenerateRequest, input_ids, im_start: int) -> PromptPrefix | None:
    """What the prefix cache keys of a request's prompt: where each message starts in its tokens
    (each opens with <|im_start|>, the generation prompt after them), each message's media digest
    and the message keys the router matches. None when the template rendered another number of
    turns than the request has messages: that prompt is not cached."""
    starts = (input_ids == im_start).nonzero().flatten().tolist()
    if len(starts) != len(request.messages) + 1:
        return None
    return PromptPrefix(tuple(starts), tuple(media_digests(request)), tuple(message_keys(request)))


class Admission:
    """The stage's admission of a request: its checks against the config, the family's adapter and
    the prompt builder (`build_prompt`: (PromptBuilder, messages) -> PromptInputs, per backend)."""

    def __init__(self, adapter: ThinkerAdapter, prompts: PromptBuilder, config: ThinkerConfig,
                 build_prompt=PromptBuilder.build, caches_prefixes: bool = False):
        self.adapter = adapter  # the family's: voices, job, talker prompt length
        self.prompts = prompts
        self.config = config
        self.build_prompt = build_prompt
        self.caches_prefixes = caches_prefixes  # the engine keeps a prefix pool: jobs carry their prompt's keys
        self.im_start = prompts.tokenizer.convert_tokens_to_ids("<|im_start|>")

    def prepare(self, request: omni_pb2.GenerateRequest, talker: common_pb2.StageLimits | None) -> Prepared:
        """Validate and convert a request; runs in a worker thread (decodes audio and images).
        `talker`: the limits of the talker replica in the route (None: text only)."""
        audio = wants_audio(request)
        talker_sampling = None
        voice = None  # what the family's job takes of the voice (adapter.resolve_voice)
        if audio:
            voice = self.adapter.resolve_voice(request.voice if request.HasField("voice") else None)
            # The talker's own limits, checked here so that a bad talker setting fails before any output.
            talker_sampling = sampling_from_proto(request.talker_sampling, "talker_sampling", 1,
                                                  talker.max_new_tokens_limit)
        forced: tuple[int, ...] = ()
        if request.HasField("forced_text"):
            forced = self._forced_ids(request)
            sampling = sampling_from_proto(common_pb2.SamplingParams(), "thinker_sampling", len(forced), len(forced))
        else:
            sampling = sampling_from_proto(request.thinker_sampling, "thinker_sampling",
                                           self.config.default_max_new_tokens, self.config.max_new_tokens_limit)
        prompt = self.build_prompt(self.prompts, messages_from_proto(request))
        capacity = self.config.engine.max_model_len
        if prompt.num_tokens + sampling.max_new_tokens > capacity:
            raise InvalidArgument("thinker_sampling.max_new_tokens",
                                  f"prompt ({prompt.num_tokens} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                                  f"exceeds the thinker's per-request cache ({capacity})")
        if talker_sampling is not None and request.talker_sampling.HasField("max_new_tokens"):
            needed = talker_sampling.max_new_tokens + self.adapter.talker_prompt_len(prompt)
            if needed > talker.max_model_len:
                raise InvalidArgument("talker_sampling.max_new_tokens",
                                      f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request "
                                      f"cache ({talker.max_model_len})")
        job = self.adapter.job(prompt, sampling, audio, forced, voice)
        if self.caches_prefixes:
            job = dataclasses.replace(job, prefix=prompt_prefix(request, prompt.input_ids[0], self.im_start))
        return Prepared(job, audio)

    def _forced_ids(self, request: omni_pb2.GenerateRequest) -> tuple[int, ...]:
        """The reply's ids for `forced_text`: the text's tokens as the assistant turn holds them
        (the prompt ends with the generation prompt's newline), then the end token."""
        if self.config.backend is not Backend.TRANSFORMERS:
            raise InvalidArgument("forced_text", f"not supported by the {self.config.backend} thinker backend")
        if not request.forced_text:
            raise InvalidArgument("forced_text", "must not be empty when set")
        if request.thinker_sampling.ListFields():
            raise InvalidArgument("thinker_sampling", "must be unset with forced_text: nothing is sampled")
        ids = tuple(self.prompts.encode_text(request.forced_text)) + (self.adapter.end_token_id(),)
        if len(ids) > self.config.max_new_tokens_limit:
            raise InvalidArgument("forced_text", f"is {len(ids)} tokens with the end token, more than the limit of "
                                                 f"{self.config.max_new_tokens_limit}")
        return ids
