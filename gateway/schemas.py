"""Pydantic models of the OpenAI requests the gateway takes.

Fields OpenAI defines that the pipeline cannot honour are declared too, so that a caller who sets
them gets a 400 naming the field instead of a silent no-op (`check_refused`); fields that do not
change the output (`user`, `metadata`, `store`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import bad_request


class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputAudio(_Open):
    data: str  # base64
    format: Literal["wav", "mp3", "flac"]


class ImageURL(_Open):
    url: str
    detail: str | None = None


class VideoURL(_Open):
    url: str


class ContentPart(_Open):
    type: Literal["text", "input_audio", "image_url", "video_url"]
    text: str | None = None
    input_audio: InputAudio | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None  # a data: URL of an mp4/webm, as vLLM's OpenAI server takes it


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # an assistant's calls (gateway/tools.py checks them)
    tool_call_id: Any = None  # a tool's result: the call it answers


class AudioParams(_Open):
    voice: str | None = None
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"


class StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # int64 or uint64; sent as uint64
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameter; only {"use_audio_in_video": bool} is read.
    mm_processor_kwargs: dict[str, Any] | None = None
    # Function calling (gateway/tools.py checks them).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Declared to be refused when set (see refused_fields).
    functions: Any = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stop: Any = None
    response_format: Any = None
    logit_bias: Any = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    prediction: Any = None


# field -> why it is refused (the 400's message).
CHAT_REFUSED = {
    "functions": "the deprecated functions are not supported: use tools",
    "function_call": "the deprecated function_call is not supported: use tool_choice",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "stop": "stop sequences are not supported",
    "response_format": "structured output is not supported",
    "logit_bias": "logit bias is not supported",
    "frequency_penalty": "frequency penalty is not supported",
    "presence_penalty": "presence penalty is not supported",
    "prediction": "predicted outputs are not supported",
}


def check_refused(request: BaseModel, refused: dict[str, str]) -> None:
    """400 naming the first refused field the caller set to something meaningful."""
    for name, reason in refused.items():
        if getattr(request, name) not in (None, False, [], {}, 0, 0.0):
            raise bad_request(name, f"{name}: {reason}", code="unsupported_parameter")


class SpeechRequest(_Open):
    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    # Not OpenAI's: the talker's frame limit for this request (12.5 frames a second for Qwen3-Omni).
    # Without it the talker's own default applies and audio cut there is an error the caller sees;
    # with it, reaching it is the end the caller asked for.
    # At most the proto's int32; the talker checks its own, lower, limit.
    max_audio_frames: int | None = Field(default=None, ge=1, le=2**31 - 1)


SPEECH_REFUSED = {
    "instructions": "voice instructions are not supported: the talker takes no instructions",
}
