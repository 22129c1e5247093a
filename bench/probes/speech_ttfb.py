"""Figure: docs/gateway.md, "Speech time to first byte". Rerun: `.venv/bin/python -m
bench.probes.speech_ttfb --requests 8`.

Time to first byte of `POST /v1/audio/speech` against TTFP. One stack (the tiny checkpoint unless
--target and --gateway-url name a running one), requests one at a time: the same text-to-speech
request (`forced_text`) over the router's gRPC API, timed to its first audio chunk (TTFP), and
through the gateway for each --formats, timed to the first byte of the HTTP body (TTFB: the gateway
encodes and sends each chunk as it comes). The figure is the ratio of the p50s, TTFB / TTFP, per
format (target: within 1.5x). Small by design: a few requests, no concurrency; the gateway's cost
under load is `omni-bench --gateway`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass

from bench.metrics import percentile

TEXT = "Hello world, this is a test of the speech endpoint."


@dataclass(frozen=True)
class SpeechTiming:
    label: str  # "grpc" or a response_format
    first_s: list[float]  # per request: first audio chunk (grpc) or first body byte (http)

    @property
    def p50(self) -> float | None:
        return percentile(self.first_s, 50)


def ratios(results: list[SpeechTiming]) -> dict[str, float | None]:
    """format -> its TTFB p50 / the gRPC TTFP p50."""
    (grpc,) = [r for r in results if r.label == "grpc"]
    return {r.label: (r.p50 / grpc.p50 if r.p50 is not None and grpc.p50 else None)
            for r in results if r.label != "grpc"}


def grpc_ttfp(target: str, voice: str, frames: int, n: int) -> SpeechTiming:
    from omni.v1 import omni_pb2
    from services.tools.client import connect

    channel, stub = connect(target)
    times = []
    try:
        for _ in range(n):
            request = omni_pb2.GenerateRequest(voice=voice, forced_text=TEXT)
            request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=TEXT)
            request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
            request.talker_sampling.max_new_tokens = frames
            sent = time.perf_counter()
            first = None
            for response in stub.Generate(request, timeout=300):
                if first is None and response.WhichOneof("event") == "audio":
                    first = time.perf_counter() - sent
            times.append(first)
    finally:
        channel.close()
    return SpeechTiming("grpc", times)


def http_ttfb(url: str, fmt: str, voice: str, frames: int, n: int) -> SpeechTiming:
    parsed = urllib.parse.urlsplit(url)
    body = json.dumps({"model": "m", "input": TEXT, "voice": voice, "response_format": fmt,
                       "max_audio_frames": frames}).encode()
    times = []
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=300)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for _ in range(n):
            sent = time.perf_counter()
            connection.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{fmt}: HTTP {response.status}: {response.read()[:300]!r}")
            response.read(1)  # the first byte of the first chunk
            times.append(time.perf_counter() - sent)
            response.read()
    finally:
        connection.close()
    return SpeechTiming(fmt, times)


def run(target: str, url: str, formats: list[str], voice: str, frames: int, n: int) -> list[SpeechTiming]:
    """Round by round, one request of each path per round, so that a busy machine's slow spells
    fall on every path alike."""
    http_ttfb(url, "pcm", voice, frames, 1)  # warm: first requests pay start-up costs
    grpc_ttfp(target, voice, frames, 1)
    times: dict[str, list[float]] = {"grpc": [], **{fmt: [] for fmt in formats}}  # path -> per request
    for _ in range(n):
        times["grpc"] += grpc_ttfp(target, voice, frames, 1).first_s
        for fmt in formats:
            times[fmt] += http_ttfb(url, fmt, voice, frames, 1).first_s
    return [SpeechTiming(label, first) for label, first in times.items()]


def report(results: list[SpeechTiming]) -> str:
    lines = [f"{'':8} {'p50 ms':>8} {'x TTFP':>7}   per request (ms)"]
    ratio = ratios(results)
    for r in results:
        x = "" if r.label == "grpc" else f"{ratio[r.label]:.2f}"
        lines.append(f"{r.label:8} {r.p50 * 1000:8.1f} {x:>7}   " + " ".join(f"{t * 1000:.0f}" for t in r.first_s))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.speech_ttfb", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="start a stack on this checkpoint (default: build the tiny one)")
    p.add_argument("--target", help="a running router instead (with --gateway-url)")
    p.add_argument("--gateway-url", help="with --target: its gateway, http://host:port")
    p.add_argument("--formats", default="pcm,mp3")
    p.add_argument("--voice", default="ethan")
    p.add_argument("--frames", type=int, default=24, help="codec frames per request (default 24)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per path (default 5)")
    p.add_argument("--json", help="also write the timings here")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if args.target:
        results = run(args.target, args.gateway_url, formats, args.voice, args.frames, args.requests)
    else:
        import tempfile
        from pathlib import Path

        from services.tools.launcher import Stack, StackOptions

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = args.checkpoint
            if checkpoint is None:
                from services.tools.tiny_checkpoint import build

                checkpoint = str(build(Path(tmp) / "tiny", seed=0))
            options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, http_port=0)
            with Stack(options) as stack:
                results = run(stack.target, stack.http_url, formats, args.voice, args.frames, args.requests)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [{"label": r.label, "first_s": r.first_s} for r in results],
                       "ratios": ratios(results)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
