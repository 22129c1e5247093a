"""Requests the stack must refuse, by name: the soak's malformed kind, and tests/reliability's."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from omni.v1 import omni_pb2
from services.tools.client import build_request


@dataclass(frozen=True)
class Malformed:
    request: omni_pb2.GenerateRequest | bytes  # bytes go through a raw call, unparsed
    names: str  # what the status details must contain
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    before_output: bool = True  # refused before any response message


def _sampling(stage: str, **values) -> Malformed:
    """A request with one bad sampling value of a stage, refused naming that field."""
    request = build_request("hi")
    for key, value in values.items():
        setattr(getattr(request, f"{stage}_sampling"), key, value)
    return Malformed(request, f"{stage}_sampling.{key}")


def _modalities(*modalities: int) -> Malformed:
    request = build_request("hi")
    del request.output_modalities[:]
    request.output_modalities.extend(modalities)
    return Malformed(request, "output_modalities")


def malformed_requests() -> dict[str, Malformed]:
    """Requests the stack must refuse, by name: INVALID_ARGUMENT naming the field (`request` for bytes
    that are no GenerateRequest at all)."""
    no_content = omni_pb2.GenerateRequest()
    no_content.messages.add(role=omni_pb2.ROLE_USER)
    empty_part = omni_pb2.GenerateRequest()
    empty_part.messages.add(role=omni_pb2.ROLE_USER).content.add()
    no_role = build_request("hi")
    no_role.messages[0].role = omni_pb2.ROLE_UNSPECIFIED
    return {
        "no messages": Malformed(omni_pb2.GenerateRequest(), "messages"),
        "message without content": Malformed(no_content, "messages[0].content"),
        "empty content part": Malformed(empty_part, "messages[0].content[0]"),
        "unspecified role": Malformed(no_role, "messages[0].role"),
        "bad audio bytes": Malformed(build_request("hi", audio=b"RIFF not really a wav"), "messages[0].content[0].audio"),
        "bad image bytes": Malformed(build_request("hi", image=b"\x89PNG garbage"), "messages[0].content[0].image"),
        "unknown voice": Malformed(build_request("hi", voice="nobody"), "voice"),
        "negative temperature": _sampling("thinker", temperature=-1.0),
        "top_p above 1": _sampling("thinker", top_p=1.5),
        "zero max_new_tokens": _sampling("thinker", max_new_tokens=0),
        "huge max_new_tokens": _sampling("thinker", max_new_tokens=10**9),
        "negative talker top_k": _sampling("talker", top_k=-3),
        "zero talker repetition_penalty": _sampling("talker", repetition_penalty=0.0),
        "huge prompt": Malformed(build_request("hello " * 5000), "prompt is"),
        "audio without text": _modalities(omni_pb2.MODALITY_AUDIO),
        "unknown modality": _modalities(omni_pb2.MODALITY_TEXT, 7),
        # The thinker checks the talker's limits too, so this is refused before any output.
        "talker max_new_tokens over its cache": _sampling("talker", max_new_tokens=5000),
        "empty bytes": Malformed(b"", "messages"),  # parses: an empty GenerateRequest
        "garbage bytes": Malformed(b"\xff\xfe garbage \x00\x01", "request: the body is not"),
        "truncated message": Malformed(build_request("hello there").SerializeToString()[:-3], "request: the body is not"),
    }
