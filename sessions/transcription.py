"""The user's transcript: each committed input audio turn transcribed by the thinker itself, a
text-only pass over the turn's audio (an ordinary `Omni/Generate` through the router, as a turn is)
with a transcription instruction. The session runs it beside the turn's response
(sessions/session.py, `transcribe`) and streams it as `transcription_*` events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from omni.v1 import common_pb2, omni_pb2
from services.base.errors import InvalidArgument

INSTRUCTION = "Transcribe the audio into text, word for word. Write only the transcript."
LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})?")  # ISO-639-1 (or -3), an optional region: en, en-US
MAX_PROMPT_CHARS = 1000
# The pass's token limit: a transcript is about 3-5 tokens a second of speech (more for a language
# written in characters), so 8 a second and 16 more bound it without cutting one short; a model that
# runs on past the words stops there.
TOKENS_PER_SECOND, TOKENS_BASE = 8, 16


@dataclass(frozen=True)
class Transcription:
    """A session's input transcription settings (`InputTranscription`, on)."""

    language: str = ""  # the audio's language ("": any)
    prompt: str = ""  # words or context to expect

    @classmethod
    def of(cls, proto: omni_pb2.InputTranscription, where: str) -> Transcription | None:
        """The settings `proto` asks for (None: off); InvalidArgument naming the field."""
        if not proto.enabled:
            return None
        if proto.language and not LANGUAGE.fullmatch(proto.language):
            raise InvalidArgument(f"{where}.language", f"{proto.language!r} is not an ISO-639 language code (en, de, zh)")
        if len(proto.prompt) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"{where}.prompt", f"at most {MAX_PROMPT_CHARS} characters")
        return cls(proto.language, proto.prompt)

    def to_proto(self) -> omni_pb2.InputTranscription:
        return omni_pb2.InputTranscription(enabled=True, language=self.language, prompt=self.prompt)

    def instruction(self) -> str:
        text = INSTRUCTION
        if self.language:
            text += f" The audio's language: {self.language}."
        if self.prompt:
            text += f" Context: {self.prompt}"
        return text

    def request(self, request_id: str, audio: bytes, audio_ms: int) -> omni_pb2.GenerateRequest:
        """The transcription pass of a turn's audio (a wav of `audio_ms`): text out only, greedy (the
        thinker's default sampling), TOKENS_PER_SECOND of audio at most."""
        tokens = TOKENS_BASE + TOKENS_PER_SECOND * -(-audio_ms // 1000)
        return omni_pb2.GenerateRequest(
            request_id=request_id, output_modalities=[omni_pb2.MODALITY_TEXT],
            thinker_sampling=common_pb2.SamplingParams(max_new_tokens=tokens),
            messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[
                omni_pb2.Content(audio=audio), omni_pb2.Content(text=self.instruction())])])
