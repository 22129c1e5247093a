"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, from gRPC statuses
(with their google.rpc details) and from the gateway's own checks."""

from __future__ import annotations

import json
import math
import re

import grpc
from fastapi.responses import JSONResponse

from services.serving.status import field_violations, retry_after_s


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# A proto field path as the pipeline names it -> the OpenAI request field a caller set.
_PARAMS = (
    (re.compile(r"^thinker_sampling\.max_new_tokens$"), "max_tokens"),
    (re.compile(r"^thinker_sampling\.(temperature|top_p|seed)$"), r"\1"),
    (re.compile(r"^thinker_sampling$"), "messages"),
    (re.compile(r"^talker_sampling\.max_new_tokens$"), "max_audio_frames"),  # speech only sets it
    (re.compile(r"^voice$"), "voice"),
    (re.compile(r"^output_modalities$"), "modalities"),
    (re.compile(r"^messages\[(\d+)\]\.content\[(\d+)\]\.audio$"), r"messages[\1].content[\2].input_audio"),
    (re.compile(r"^messages\[(\d+)\]\.content\[(\d+)\]\.image$"), r"messages[\1].content[\2].image_url"),
    (re.compile(r"^messages\[(\d+)\]\.content\[(\d+)\]\.video$"), r"messages[\1].content[\2].video_url"),
    (re.compile(r"^use_audio_in_video$"), "mm_processor_kwargs.use_audio_in_video"),
    (re.compile(r"^forced_text$"), "input"),
    (re.compile(r"^tools\[(\d+)\]\.(\w+)$"), r"tools[\1].function.\2"),
    (re.compile(r"^tool_choice\.function$"), "tool_choice.function.name"),
    (re.compile(r"^messages\[(\d+)\]\.tool_calls\[(\d+)\]\.(name|arguments)$"), r"messages[\1].tool_calls[\2].function.\3"),
)


def openai_param(field: str, speech: bool = False) -> str:
    for pattern, replacement in _PARAMS:
        if pattern.match(field):
            param = pattern.sub(replacement, field)
            if param == "voice" and not speech:
                return "audio.voice"
            return param
    return field


def from_rpc(err: grpc.RpcError, speech: bool = False) -> APIError:
    """A failed router call -> the HTTP error a caller of OpenAI's API expects."""
    code = err.code()
    message = err.details() or code.name
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        violations = field_violations(err)
        param = openai_param(violations[0][0], speech) if violations else None
        return APIError(400, message, "invalid_request_error", param, "invalid_value")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return APIError(401, message, "invalid_request_error", None, "invalid_api_key")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return APIError(403, message, "invalid_request_error", None, "permission_denied")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = retry_after_s(err)
        headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else {}
        if retry is not None:
            headers["retry-after-ms"] = str(max(1, round(retry * 1000)))
        return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", headers)
    if code is grpc.StatusCode.UNAVAILABLE:
        return APIError(503, message, "server_error", None, "service_unavailable")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, message, "timeout_error", None, "deadline_exceeded")
    if code is grpc.StatusCode.CANCELLED:
        return APIError(499, message, "server_error", None, "cancelled")
    return APIError(500, message, "server_error", None, code.name.lower())


def from_validation(errors: list[dict]) -> APIError:
    """A pydantic validation failure -> 400 naming the bad field (`messages[0].content[1].type`): the
    deepest one, since a union (`content`: a string or a list of parts) reports every member."""
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"loc": (), "msg": "invalid request"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_union_tag(part):
            param += f".{part}" if param else str(part)
    message = f"{param or 'request body'}: {first.get('msg', 'invalid')}"
    return APIError(400, message, "invalid_request_error", param or None, "invalid_value")


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member it tried (`str`, `list[ContentPart]`) in the location.
    return part in ("str", "list[ContentPart]") or part.startswith("function-") or part.startswith("list[")
