"""A realtime session's settings: what the client chose (`Settings`), checked field by field, and
the Generate request of a turn they make (the service's bounds on every session are
sessions/config.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from omni.v1 import common_pb2, omni_pb2
from services.base.errors import InvalidArgument
from services.base.tool_calls import check_tools
from sessions.audio import DEFAULT_FORMAT, InputFormat, input_format
from sessions.transcription import Transcription
from sessions.turn_detection import TurnDetectionSettings

_MODES = omni_pb2.ToolChoice

TEXT, AUDIO = omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO
DEFAULT_RETENTION = 0.8  # of the conversation's turns kept when a turn does not fit (`Truncation`)


@dataclass(frozen=True)
class Settings:
    instructions: str = ""
    voice: str | None = None
    # Serialized omni.v1.SamplingParams (a frozen value; b"": the server's defaults).
    thinker_sampling: bytes = b""
    talker_sampling: bytes = b""
    output_modalities: tuple[int, ...] = (TEXT, AUDIO)
    turn_detection: TurnDetectionSettings = field(default_factory=TurnDetectionSettings)
    input_format: InputFormat = DEFAULT_FORMAT
    return_codec_frames: bool = False
    # Serialized omni.v1.Tool each, and omni.v1.ToolChoice (b"": auto).
    tools: tuple[bytes, ...] = ()
    tool_choice: bytes = b""
    # A turn that does not fit: its oldest turns dropped to this share of the turns (0: it fails).
    retention_ratio: float = DEFAULT_RETENTION
    transcription: Transcription | None = None  # each committed audio turn transcribed (None: off)

    def updated(self, proto: omni_pb2.SessionSettings, field_: str = "update") -> Settings:
        """These settings with what `proto` sets, each checked (InvalidArgument names the field)."""
        changes: dict = {}
        if proto.HasField("instructions"):
            changes["instructions"] = proto.instructions
        if proto.HasField("voice"):
            changes["voice"] = proto.voice or None
        for name in ("thinker_sampling", "talker_sampling"):
            if proto.HasField(name):
                changes[name] = getattr(proto, name).SerializeToString(deterministic=True)
        if proto.output_modalities:
            modalities = tuple(dict.fromkeys(proto.output_modalities))
            if TEXT not in modalities or not set(modalities) <= {TEXT, AUDIO}:
                raise InvalidArgument(f"{field_}.output_modalities", "must be [TEXT] or [TEXT, AUDIO]")
            changes["output_modalities"] = tuple(sorted(modalities))
        if proto.HasField("turn_detection"):
            changes["turn_detection"] = self.turn_detection.updated(proto.turn_detection, f"{field_}.turn_detection")
        if proto.HasField("input_format"):
            changes["input_format"] = input_format(proto.input_format, f"{field_}.input_format")
        if proto.HasField("return_codec_frames"):
            changes["return_codec_frames"] = proto.return_codec_frames
        if proto.tools_set:
            check_tools([(t.name, t.description, t.parameters) for t in proto.tools], f"{field_}.tools")
            changes["tools"] = tuple(t.SerializeToString(deterministic=True) for t in proto.tools)
        elif proto.tools:
            raise InvalidArgument(f"{field_}.tools_set", "must be true to set the tools")
        if proto.HasField("tool_choice"):
            changes["tool_choice"] = proto.tool_choice.SerializeToString(deterministic=True)
        if proto.HasField("truncation"):
            changes["retention_ratio"] = retention(proto.truncation, f"{field_}.truncation")
        if proto.HasField("input_transcription"):
            changes["transcription"] = Transcription.of(proto.input_transcription, f"{field_}.input_transcription")
        settings = replace(self, **changes)
        settings.check_tool_choice(f"{field_}.tool_choice")
        return settings

    def for_response(self, create: omni_pb2.CreateResponse) -> Settings:
        """These settings with a response's overrides, each checked (InvalidArgument naming the
        `create_response` field)."""
        overrides = omni_pb2.SessionSettings(output_modalities=create.output_modalities, tools=create.tools,
                                             tools_set=create.tools_set)
        if create.HasField("instructions"):
            overrides.instructions = create.instructions
        if create.HasField("tool_choice"):
            overrides.tool_choice.CopyFrom(create.tool_choice)
        if create.HasField("max_output_tokens"):
            sampling = common_pb2.SamplingParams.FromString(self.thinker_sampling)
            if create.max_output_tokens:
                sampling.max_new_tokens = create.max_output_tokens
            else:
                sampling.ClearField("max_new_tokens")
            overrides.thinker_sampling.CopyFrom(sampling)
        if create.tools_set and not create.HasField("tool_choice"):
            overrides.tool_choice.CopyFrom(omni_pb2.ToolChoice())  # the session's choice may name a tool it drops
        return self.updated(overrides, "create_response")

    @property
    def max_output_tokens(self) -> int | None:
        """The thinker's token limit these settings ask for (None: the thinker's own)."""
        sampling = common_pb2.SamplingParams.FromString(self.thinker_sampling)
        return sampling.max_new_tokens if sampling.HasField("max_new_tokens") else None

    def check_tool_choice(self, where: str) -> None:
        choice = omni_pb2.ToolChoice.FromString(self.tool_choice)
        names = {omni_pb2.Tool.FromString(t).name for t in self.tools}
        if choice.mode not in _MODES.Mode.values():
            raise InvalidArgument(f"{where}.mode", f"unknown mode {choice.mode}")
        if choice.mode in (_MODES.MODE_REQUIRED, _MODES.MODE_FUNCTION) and not names:
            raise InvalidArgument(where, "asks for a call, and the session has no tools")
        if choice.mode == _MODES.MODE_FUNCTION and choice.function not in names:
            raise InvalidArgument(f"{where}.function", f"{choice.function!r} is not one of the session's tools")

    def to_proto(self) -> omni_pb2.SessionSettings:
        settings = omni_pb2.SessionSettings(
            instructions=self.instructions, output_modalities=self.output_modalities,
            turn_detection=self.turn_detection.to_proto(), input_format=self.input_format.to_proto(),
            return_codec_frames=self.return_codec_frames,
            thinker_sampling=common_pb2.SamplingParams.FromString(self.thinker_sampling),
            talker_sampling=common_pb2.SamplingParams.FromString(self.talker_sampling),
            tools=[omni_pb2.Tool.FromString(t) for t in self.tools], tools_set=True,
            tool_choice=omni_pb2.ToolChoice.FromString(self.tool_choice),
            truncation=omni_pb2.Truncation(enabled=self.retention_ratio > 0, retention_ratio=self.retention_ratio),
            input_transcription=self.transcription.to_proto() if self.transcription else omni_pb2.InputTranscription())
        if self.voice is not None:
            settings.voice = self.voice
        return settings

    def request(self, request_id: str, messages: list[omni_pb2.Message]) -> omni_pb2.GenerateRequest:
        """One turn: the conversation so far as an ordinary Generate request."""
        system = [omni_pb2.Message(role=omni_pb2.ROLE_SYSTEM, content=[omni_pb2.Content(text=self.instructions)])]
        request = omni_pb2.GenerateRequest(
            request_id=request_id, messages=(system if self.instructions else []) + messages,
            output_modalities=self.output_modalities, return_codec_frames=self.return_codec_frames,
            thinker_sampling=common_pb2.SamplingParams.FromString(self.thinker_sampling),
            talker_sampling=common_pb2.SamplingParams.FromString(self.talker_sampling),
            tools=[omni_pb2.Tool.FromString(t) for t in self.tools],
            tool_choice=omni_pb2.ToolChoice.FromString(self.tool_choice))
        if self.voice is not None:
            request.voice = self.voice
        return request


def retention(truncation: omni_pb2.Truncation, where: str) -> float:
    """The share of turns a truncation keeps (0: truncation off); InvalidArgument naming the field."""
    if not truncation.enabled:
        return 0.0
    ratio = truncation.retention_ratio or DEFAULT_RETENTION
    if not 0 < ratio < 1:
        raise InvalidArgument(f"{where}.retention_ratio", f"must be above 0 and below 1, got {ratio}")
    return ratio
