"""One `Omni/Generate` call, run to its end on the calling thread, that other threads may watch and
cancel: what the soak sends, and the reliability tests too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import grpc

from omni.v1 import omni_pb2

GENERATE = "/omni.v1.Omni/Generate"
Code = grpc.StatusCode


class CancelWhen(Enum):
    BEFORE_FIRST = "before_first"  # after `delay_s`, whatever has arrived (usually nothing)
    AFTER_TEXT = "after_text"  # once `count` text tokens have arrived
    AFTER_AUDIO = "after_audio"  # once `count` audio chunks have arrived


@dataclass(frozen=True)
class CancelPoint:
    when: CancelWhen
    count: int = 1
    delay_s: float = 0.0

    def reached(self, call: Call) -> bool:
        if self.when is CancelWhen.AFTER_TEXT:
            return call.texts >= self.count
        if self.when is CancelWhen.AFTER_AUDIO:
            return call.audios >= self.count
        return False


class Call:
    """One `Omni/Generate` call, run to its end by `run()` on the calling thread.

    Other threads may read its progress (`texts`: text tokens, `audios`: chunks) or `cancel()` it. `method` is a stub's
    `Generate`, or a raw `channel.unary_stream(GENERATE)` for a request given as bytes. `on_response(call)`, if
    given, runs on the calling thread after each response is counted and before the cancel point is checked
    (a test reads the stages' loads there while the request is certainly still running)."""

    def __init__(self, method, request, timeout: float, cancel_at: CancelPoint | None = None,
                 on_response: Callable[[Call], None] | None = None):
        self.method = method
        self.request = request
        self.timeout = timeout
        self.cancel_at = cancel_at
        self.on_response = on_response
        self.texts = self.audios = self.messages = 0
        self.final: omni_pb2.Final | None = None
        self.code: grpc.StatusCode | None = None  # None while running
        self.details = ""
        self.error: grpc.RpcError | None = None  # how it failed (status details: error_info and the like)
        self.started = self.first_message = self.ended = None  # perf_counter times
        self.cancelled_at: float | None = None
        self.done = threading.Event()
        self._call = None
        self._lock = threading.Lock()

    def run(self) -> Call:
        self.started = time.perf_counter()
        try:
            with self._lock:
                self._call = self.method(self.request, timeout=self.timeout)
                cancel_now = self.cancelled_at is not None
            if cancel_now:
                self._call.cancel()
            point = self.cancel_at
            if point is not None and point.when is CancelWhen.BEFORE_FIRST:
                time.sleep(point.delay_s)
                self.cancel()
            for response in self._call:
                self._note(response)
                if self.on_response is not None:
                    self.on_response(self)
                if point is not None and point.reached(self):
                    self.cancel()
            self.code = Code.OK
        except grpc.RpcError as exc:
            self.code, self.details, self.error = exc.code(), exc.details() or "", exc
        self.ended = time.perf_counter()
        self.done.set()
        return self

    def _note(self, response) -> None:
        self.messages += 1
        if self.first_message is None:
            self.first_message = time.perf_counter()
        kind = response.WhichOneof("event") if isinstance(response, omni_pb2.GenerateResponse) else None
        if kind == "text":
            self.texts += len(response.text.token_ids)  # a delta carries one or more tokens
        elif kind == "audio":
            self.audios += 1
        elif kind == "final":
            self.final = response.final

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled_at is None:
                self.cancelled_at = time.perf_counter()
            if self._call is not None:
                self._call.cancel()

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


def method_for(channel: grpc.Channel, request) -> Callable:
    """The Generate multi-callable for a request: typed, or raw bytes for unparsed ones."""
    if isinstance(request, bytes):
        return channel.unary_stream(GENERATE)
    return channel.unary_stream(GENERATE, request_serializer=omni_pb2.GenerateRequest.SerializeToString,
                                response_deserializer=omni_pb2.GenerateResponse.FromString)
