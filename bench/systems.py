"""The systems under test, each run as one block: a list of prompts at a fixed concurrency.

- `pipeline`: the router's `Generate`, streamed. Concurrency N = N client threads, each sending
  its next request when its previous one ended (closed loop), over one gRPC channel.
- `reference`: transformers' `generate` one request at a time, as a server that wraps it would:
  the same N client threads in front of one generate at a time (first come, first served), so a
  request's latency includes its wait for the requests ahead of it.
- `reference-batched`: `generate` over batches of N requests sent together; every request of a
  batch gets its text and audio when the batch ends.
- `gateway` (opt-in, `--gateway`): the same requests as `pipeline`, to the same stack, through the
  OpenAI-compatible HTTP gateway (`POST /v1/chat/completions`, streamed SSE with pcm16 audio), N
  client threads with a keep-alive connection each: the gateway's added latency and cost.

Nothing is streamed by `generate`, so for both reference systems TTFT = TTFP = the time to the
whole response.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from bench.loop import closed_loop
from bench.metrics import RequestTiming, whole_response
from bench.prompts import BenchPrompt
from bench.reference import Generated, Reference
from services.base.stages import SPEECH_SAMPLE_RATE
from services.tools.client import build_request, collect, connect


class System(enum.Enum):
    REFERENCE = "reference"
    REFERENCE_BATCHED = "reference-batched"
    PIPELINE = "pipeline"
    PIPELINE_UNBATCHED = "pipeline-unbatched"  # the same stack, thinker and talker at --max-batch-size 1
    PIPELINE_GEMM = "pipeline-gemm"  # the same stack, thinker and talker at --exact-batching gemm (opt-in: --gemm)
    GATEWAY = "gateway"  # the pipeline's stack through the HTTP gateway (opt-in: --gateway)


@dataclass(frozen=True)
class Outcome:
    timing: RequestTiming | None  # None when the request failed
    text_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    system: System
    concurrency: int
    round: int
    prompt_index: int
    outcome: Outcome


@dataclass(frozen=True)
class BlockResult:
    outcomes: list[Outcome]  # in the order of the block's prompts
    wall_s: float  # first send to last completion


def run_closed_loop(items: list, concurrency: int, call: Callable[[object], Outcome],
                    on_done: Callable[[Outcome], None] = lambda _: None) -> BlockResult:
    """`concurrency` threads take the next item as soon as their previous call returned."""
    outcomes, wall = closed_loop(items, concurrency, call,
                                 lambda exc: Outcome(None, error=f"{type(exc).__name__}: {exc}"), on_done)
    return BlockResult(outcomes=outcomes, wall_s=wall)


class PipelineSystem:
    """Requests through the router; request messages are built before the clock starts."""

    def __init__(self, target: str, voice: str | None, max_new_tokens: int, talker_max_new_tokens: int,
                 timeout_s: float):
        self.channel, self.stub = connect(target)
        self.voice = voice
        self.max_new_tokens = max_new_tokens
        self.talker_max_new_tokens = talker_max_new_tokens
        self.timeout_s = timeout_s

    def request(self, prompt: BenchPrompt):
        return build_request(prompt.text, prompt.system, prompt.audio, prompt.image, self.voice,
                             max_new_tokens=self.max_new_tokens, talker_max_new_tokens=self.talker_max_new_tokens,
                             video=prompt.video)

    def call(self, request) -> Outcome:
        try:
            result = collect(self.stub, request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            return Outcome(None, error=f"{exc.code().name}: {exc.details()}")
        done = time.perf_counter()
        rel = lambda times: tuple(t - result.sent for t in times)  # noqa: E731
        timing = RequestTiming(
            text_times=rel(result.text_times), audio_times=rel(result.audio_times),
            audio_durations=tuple(c.size / result.sample_rate for c in result.audio_chunks), done=done - result.sent,
        )
        return Outcome(timing, text_tokens=len(result.thinker_token_ids))

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        return run_closed_loop([self.request(p) for p in prompts], concurrency, self.call, on_done)

    def close(self) -> None:
        self.channel.close()


class GatewaySystem:
    """The pipeline's requests through the HTTP gateway: one streamed chat completion each (stdlib
    http.client, so the client's own cost stays small). The talker's length is the stack's
    `--default-max-new-tokens` (the OpenAI API has no field for it): the harness starts the stack
    with the benchmark's talker limit, so both paths make the same audio."""

    def __init__(self, url: str, voice: str | None, max_new_tokens: int, timeout_s: float):
        import threading
        import urllib.parse

        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.voice = voice  # None: the gateway's default voice (the checkpoint family's)
        self.max_new_tokens = max_new_tokens
        self.timeout_s = timeout_s
        self.local = threading.local()  # one keep-alive connection per client thread
        self.connections = []

    def request(self, prompt: BenchPrompt) -> bytes:
        import base64
        import json

        content = []
        if prompt.audio is not None:
            content.append({"type": "input_audio",
                            "input_audio": {"data": base64.b64encode(prompt.audio).decode(), "format": "wav"}})
        if prompt.image is not None:
            content.append({"type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + base64.b64encode(prompt.image).decode()}})
        if prompt.video is not None:
            content.append({"type": "video_url",
                            "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(prompt.video).decode()}})
        content.append({"type": "text", "text": prompt.text})
        messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
            {"role": "user", "content": content}]
        return json.dumps({"model": "omni", "messages": messages, "max_tokens": self.max_new_tokens,
                           "modalities": ["text", "audio"],
                           "audio": {**({"voice": self.voice} if self.voice else {}), "format": "pcm16"},
                           "stream": True, "stream_options": {"include_usage": True}}).encode()

    def _connection(self, fresh: bool = False):
        import http.client
        import socket

        connection = getattr(self.local, "connection", None)
        if connection is not None and fresh:
            connection.close()
            connection = None
        if connection is None:
            connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            connection.connect()
            # http.client sends the headers and the body in two writes: without this, Nagle's
            # algorithm holds the body until the server's delayed ACK (~40 ms on Linux).
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local.connection = connection
            self.connections.append(connection)
        return connection

    def _send(self, body: bytes, sent_box: list):
        """POST on this thread's keep-alive connection; once more on a fresh one if the server had
        closed the idle one (nothing was processed then)."""
        import http.client

        for attempt in (0, 1):
            connection = self._connection(fresh=attempt == 1)
            sent_box[0] = time.perf_counter()
            try:
                connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                return connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if attempt == 1:
                    raise

    def call(self, body: bytes) -> Outcome:
        import base64
        import json

        text_times, audio_times, durations, text_tokens = [], [], [], 0
        sent_box = [time.perf_counter()]
        try:
            response = self._send(body, sent_box)
            sent = sent_box[0]
            if response.status != 200:
                return Outcome(None, error=f"HTTP {response.status}: {response.read()[:300]!r}")
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                now = time.perf_counter() - sent
                if "error" in event:
                    response.read()
                    return Outcome(None, error=f"stream error: {event['error'].get('message')}")
                if event.get("usage"):
                    text_tokens = event["usage"]["completion_tokens_details"]["text_tokens"]
                for choice in event.get("choices", ()):
                    audio = choice.get("delta", {}).get("audio") or {}
                    if audio.get("transcript"):
                        text_times.append(now)
                    if audio.get("data"):
                        audio_times.append(now)
                        durations.append(len(base64.b64decode(audio["data"])) / 2 / SPEECH_SAMPLE_RATE)
            response.read()  # the rest (nothing after [DONE]): the connection is reusable
        except (OSError, ValueError) as exc:
            if getattr(self.local, "connection", None) is not None:
                self.local.connection.close()
                self.local.connection = None
            return Outcome(None, error=f"{type(exc).__name__}: {exc}")
        timing = RequestTiming(text_times=tuple(text_times), audio_times=tuple(audio_times),
                               audio_durations=tuple(durations), done=time.perf_counter() - sent)
        return Outcome(timing, text_tokens=text_tokens)

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        return run_closed_loop([self.request(p) for p in prompts], concurrency, self.call, on_done)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


class ReferenceSystem:
    """One generate at a time behind `concurrency` clients, first come first served."""

    def __init__(self, reference: Reference):
        self.reference = reference
        # One worker with a FIFO queue: a server that wraps generate without batching.
        self.server = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")

    def _serve(self, prompt: BenchPrompt) -> tuple[float, float, Generated]:
        started = time.perf_counter()
        generated = self.reference.generate([prompt])[0]
        return started, time.perf_counter() - started, generated

    def call(self, prompt: BenchPrompt) -> Outcome:
        sent = time.perf_counter()
        started, wall, generated = self.server.submit(self._serve, prompt).result()
        return Outcome(whole_response(wall, generated.audio_seconds, wait_s=started - sent), generated.text_tokens)

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        return run_closed_loop(prompts, concurrency, self.call, on_done)

    def close(self) -> None:
        self.server.shutdown()


class BatchedReferenceSystem:
    """Batches of `concurrency` requests, one generate each."""

    def __init__(self, reference: Reference):
        self.reference = reference

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        outcomes: list[Outcome] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), concurrency):
            batch = prompts[first:first + concurrency]
            sent = time.perf_counter()
            try:
                generated = self.reference.generate(batch)
                wall = time.perf_counter() - sent
                done = [Outcome(whole_response(wall, g.audio_seconds), g.text_tokens) for g in generated]
            except Exception as exc:
                done = [Outcome(None, error=f"{type(exc).__name__}: {exc}")] * len(batch)
            for outcome in done:
                outcomes.append(outcome)
                on_done(outcome)
        return BlockResult(outcomes=outcomes, wall_s=time.perf_counter() - start)
