"""A thinker request's admission, in one place: what the request asks (`wants_audio`), its messages
(`messages_from_proto`), its tools (`Tools`) and prompt, its sampling against this stage's limits
and the talker's, the forced reply of a text-to-speech request, its prefix-cache keys
(`prompt_prefix`): checked and converted before any work, each refusal an InvalidArgument naming
the field. `Admission.prepare` runs in a worker thread (it decodes audio, images and video); the
stream (stream.py `admit`) asks the talker replica's limits first.

NOTE: scripted replies, for tests only. The tiny checkpoints never call a tool by themselves, so
the function-calling tests set OMNI_THINKER_TEST_REPLIES to a JSON object {text: reply}: a request
whose last message's text holds `text` gets `reply` as its forced reply (as `forced_text` does: its
tokens are fed through the thinker as if generated). Unset, nothing changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from omni.v1 import common_pb2, omni_pb2
from services.base.errors import ContextFull, InvalidArgument
from services.base.tool_calls import call_opening, check_tools
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.prefix.keys import PromptPrefix
from services.serving.convert import sampling_from_proto
from services.serving.prefix_keys import media_digests, message_keys
from services.thinker.adapter import ThinkerAdapter
from services.thinker.config import Backend, ThinkerConfig
from services.thinker.engine import ThinkerJob

_ROLES = {omni_pb2.ROLE_SYSTEM: Role.SYSTEM, omni_pb2.ROLE_USER: Role.USER, omni_pb2.ROLE_ASSISTANT: Role.ASSISTANT,
          omni_pb2.ROLE_TOOL: Role.TOOL}
TEST_REPLIES = "OMNI_THINKER_TEST_REPLIES"  # the module's NOTE


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
    tools: bool = False  # the reply may call a tool: the talker speaks only the text before a call
    reply_prefix: str = ""  # the reply's start, in the prompt (tool_choice required / a function): its first text


@dataclass(frozen=True)
class Tools:
    """A request's tools as its prompt renders them (None: none rendered) and the reply's forced start."""

    tools: list[dict] | None = None
    reply_prefix: str = ""

    @classmethod
    def of(cls, request: omni_pb2.GenerateRequest) -> Tools:
        choice = request.tool_choice
        if choice.mode not in omni_pb2.ToolChoice.Mode.values():
            raise InvalidArgument("tool_choice.mode", f"unknown mode {choice.mode}")
        if choice.function and choice.mode != omni_pb2.ToolChoice.MODE_FUNCTION:
            raise InvalidArgument("tool_choice.function", "is for MODE_FUNCTION only")
        tools = check_tools([(t.name, t.description, t.parameters) for t in request.tools], "tools")
        if choice.mode in (omni_pb2.ToolChoice.MODE_REQUIRED, omni_pb2.ToolChoice.MODE_FUNCTION) and not tools:
            raise InvalidArgument("tool_choice", "asks for a call, and the request has no tools")
        if choice.mode == omni_pb2.ToolChoice.MODE_FUNCTION and choice.function not in {t.name for t in request.tools}:
            raise InvalidArgument("tool_choice.function", f"{choice.function!r} is not one of the request's tools")
        if not tools or choice.mode == omni_pb2.ToolChoice.MODE_NONE:
            return cls()
        if choice.mode == omni_pb2.ToolChoice.MODE_REQUIRED:
            return cls(tools, call_opening(None))
        if choice.mode == omni_pb2.ToolChoice.MODE_FUNCTION:
            return cls(tools, call_opening(choice.function))
        return cls(tools)


def _tool_calls(message: omni_pb2.Message, where: str) -> tuple[dict, ...]:
    """An assistant turn's calls as the chat template takes them (arguments a dict when JSON)."""
    calls = []
    for k, call in enumerate(message.tool_calls):
        if not call.name:
            raise InvalidArgument(f"{where}.tool_calls[{k}].name", "a call names its function")
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = call.arguments  # as the model wrote it
        calls.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
    return tuple(calls)


def messages_from_proto(request: omni_pb2.GenerateRequest) -> list[ChatMessage]:
    messages = []
    for i, message in enumerate(request.messages):
        if message.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role", "must be ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL")
        if message.tool_calls and message.role != omni_pb2.ROLE_ASSISTANT:
            raise InvalidArgument(f"messages[{i}].tool_calls", "only an assistant turn makes calls")
        if message.role == omni_pb2.ROLE_TOOL:
            if not message.tool_call_id:
                raise InvalidArgument(f"messages[{i}].tool_call_id", "a tool's result names the call it answers")
            if any(c.WhichOneof("part") != "text" for c in message.content):
                raise InvalidArgument(f"messages[{i}].content", "a tool's result holds text parts only")
        elif message.tool_call_id:
            raise InvalidArgument(f"messages[{i}].tool_call_id", "is for ROLE_TOOL turns only")
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
        messages.append(ChatMessage(_ROLES[message.role], tuple(parts), _tool_calls(message, f"messages[{i}]"),
                                    message.tool_call_id or None))
    return messages


def prompt_prefix(request: omni_pb2.GenerateRequest, input_ids, im_start: int,
                  tools: bool = False) -> PromptPrefix | None:
    """What the prefix cache keys of a request's prompt: where each message starts in its tokens
    (each opens with <|im_start|>, the generation prompt after them), each message's media digest
    and the message keys the router matches. None when the template rendered another number of
    turns than the request has messages: that prompt is not cached. With `tools` rendered and no
    system message first (a turn of its own) or tool results in a row (one turn), the turns need
    not line up with the messages even where their numbers agree: not cached either."""
    roles = [m.role for m in request.messages]
    if ((tools and roles[:1] != [omni_pb2.ROLE_SYSTEM])
            or any(a == b == omni_pb2.ROLE_TOOL for a, b in zip(roles, roles[1:]))):
        return None
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
        self.test_replies: dict[str, str] = json.loads(os.environ.get(TEST_REPLIES) or "{}")

    def prepare(self, request: omni_pb2.GenerateRequest, talker: common_pb2.StageLimits | None) -> Prepared:
        """Validate and convert a request; runs in a worker thread (decodes audio and images).
        `talker`: the limits of the talker replica in the route (None: text only)."""
        tools = self._tools(request)
        messages = messages_from_proto(request)
        # A reply that starts with a call has nothing to speak.
        audio = wants_audio(request) and not tools.reply_prefix
        talker_sampling = None
        voice = None  # what the family's job takes of the voice (adapter.resolve_voice)
        if audio:
            voice = self.adapter.resolve_voice(request.voice if request.HasField("voice") else None)
            # The talker's own limits, checked here so that a bad talker setting fails before any output.
            talker_sampling = sampling_from_proto(request.talker_sampling, "talker_sampling", 1,
                                                  talker.max_new_tokens_limit)
        forced: tuple[int, ...] = ()
        scripted = None if request.HasField("forced_text") else self._test_reply(messages)
        if request.HasField("forced_text") or scripted is not None:
            forced = self._forced_ids(request, scripted)
            sampling = sampling_from_proto(common_pb2.SamplingParams(), "thinker_sampling", len(forced), len(forced))
        else:
            sampling = sampling_from_proto(request.thinker_sampling, "thinker_sampling",
                                           self.config.default_max_new_tokens, self.config.max_new_tokens_limit)
        if tools.tools is None:
            prompt = self.build_prompt(self.prompts, messages)
        else:
            prompt = self.build_prompt(self.prompts, messages, tools=tools.tools, reply_prefix=tools.reply_prefix)
        capacity = self.config.engine.max_model_len
        if prompt.num_tokens + sampling.max_new_tokens > capacity:
            raise ContextFull("thinker_sampling.max_new_tokens",
                              f"prompt ({prompt.num_tokens} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                              f"exceeds the thinker's per-request cache ({capacity})")
        if talker_sampling is not None and request.talker_sampling.HasField("max_new_tokens"):
            needed = talker_sampling.max_new_tokens + self.adapter.talker_prompt_len(prompt)
            if needed > talker.max_model_len:
                raise ContextFull("talker_sampling.max_new_tokens",
                                  f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request "
                                  f"cache ({talker.max_model_len})")
        job = self.adapter.job(prompt, sampling, audio, forced, voice)
        if self.caches_prefixes:
            job = dataclasses.replace(job, prefix=prompt_prefix(request, prompt.input_ids[0], self.im_start,
                                                                tools.tools is not None))
        return Prepared(job, audio, tools.tools is not None, tools.reply_prefix)

    @property
    def tools_refused(self) -> str | None:
        """Why this stage refuses every request with tools (None: it takes them). Reported on
        GetLoad, so the router can tell the sessions service before a session sets tools."""
        if self.config.backend is not Backend.TRANSFORMERS:
            return f"not supported by the {self.config.backend} thinker backend"
        if not self.prompts.renders_tools:
            return "the checkpoint's chat template does not render tools"
        return None

    def _tools(self, request: omni_pb2.GenerateRequest) -> Tools:
        """The request's tools checked (before anything is decoded), against what this stage can render."""
        tools = Tools.of(request)
        if not request.tools:
            return tools
        if self.tools_refused is not None:
            raise InvalidArgument("tools", self.tools_refused)
        for i, tool in enumerate(request.tools):
            self.prompts.check_text(tool.description, f"tools[{i}].description")
            self.prompts.check_text(tool.parameters, f"tools[{i}].parameters")
        for i, message in enumerate(request.messages):
            for k, call in enumerate(message.tool_calls):
                self.prompts.check_text(call.arguments, f"messages[{i}].tool_calls[{k}].arguments")
        return tools

    def _test_reply(self, messages: list[ChatMessage]) -> str | None:
        """The scripted reply of the module's NOTE, when one applies."""
        if not self.test_replies or not messages:
            return None
        text = "".join(part.text for part in messages[-1].parts if part.text is not None)
        return next((reply for key, reply in self.test_replies.items() if key in text), None)

    def _forced_ids(self, request: omni_pb2.GenerateRequest, scripted: str | None = None) -> tuple[int, ...]:
        """The reply's ids for `forced_text` (or a scripted reply): the text's tokens as the
        assistant turn holds them (the prompt ends with the generation prompt's newline), then the
        end token."""
        if self.config.backend is not Backend.TRANSFORMERS:
            raise InvalidArgument("forced_text", f"not supported by the {self.config.backend} thinker backend")
        if scripted is not None:
            text = scripted
        elif not request.forced_text:
            raise InvalidArgument("forced_text", "must not be empty when set")
        elif request.thinker_sampling.ListFields():
            raise InvalidArgument("thinker_sampling", "must be unset with forced_text: nothing is sampled")
        else:
            text = request.forced_text
        ids = tuple(self.prompts.encode_text(text)) + (self.adapter.end_token_id(),)
        if len(ids) > self.config.max_new_tokens_limit:
            raise InvalidArgument("forced_text", f"is {len(ids)} tokens with the end token, more than the limit of "
                                                 f"{self.config.max_new_tokens_limit}")
        return ids
