"""Figures: docs/sessions.md, "What turn detection costs" (event-loop lag with N sessions talking).
Rerun: `.venv/bin/python -m bench.probes.sessions_loop_lag [sessions] [seconds]` (default 32, 20).

The stack on the tiny checkpoint (models/tiny-qwen3-omni); N sessions on its sessions service, each
streaming the committed recordings (bench/speech/, 1 s of digital silence after each, pcm16 at
24 kHz) in real time in 20 ms appends, turn detection on and no responses (the detector's load
alone); then, from the two services' /metrics, the event loops' lag p99 (the upper bound of the
histogram bucket that holds it: omni_session_loop_lag_seconds, omni_router_loop_lag_seconds) and
turn detection's CPU per second of audio (the detection thread's).
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import numpy as np

from bench.probes.turn_detection_cpu import RATE, recordings
from bench.stage_metrics import histogram_quantile, scrape
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.tools.launcher import Stack, StackOptions, free_port

CHUNK = RATE * 20 // 1000 * 2  # bytes of 20 ms


def metrics(port: int) -> dict:
    return scrape(f"http://127.0.0.1:{port}/metrics")


def p99(samples: dict, name: str) -> tuple[float, int]:
    """The lag p99's bucket bound over the process's life, and the ticks observed."""
    return histogram_quantile({}, samples, name, 0.99), int(samples[(f"{name}_count", ())])


async def talk(target: str, pcm: bytes, seconds: float) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        call = omni_pb2_grpc.SessionsStub(channel).Session()
        await call.write(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(
            input_format=omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=RATE),
            turn_detection=omni_pb2.TurnDetection(create_response=False))))
        start, sent = time.monotonic(), 0
        while sent * 0.02 < seconds:
            i = (sent * CHUNK) % (len(pcm) - CHUNK)
            await call.write(omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=pcm[i:i + CHUNK])))
            sent += 1
            await asyncio.sleep(max(start + sent * 0.02 - time.monotonic(), 0))
        call.cancel()


async def run(target: str, sessions: int, seconds: float) -> None:
    pcm = np.concatenate([x for s in recordings() for x in (s, np.zeros(RATE, np.int16))]).astype("<i2").tobytes()
    await asyncio.gather(*(talk(target, pcm, seconds) for _ in range(sessions)))


def main(sessions: int = 32, seconds: float = 20.0) -> None:
    router_port, sessions_port = free_port(), free_port()
    options = StackOptions(checkpoint="models/tiny-qwen3-omni", port=0, log_prefix=False,
                           router_args=("--metrics-port", str(router_port)),
                           sessions_args=("--metrics-port", str(sessions_port)))
    with Stack(options) as stack:
        before = metrics(sessions_port)
        asyncio.run(run(stack.sessions_target, sessions, seconds))
        after = metrics(sessions_port)
        cpu, audio = ("omni_session_turn_detection_cpu_seconds_total", "omni_session_turn_detection_audio_seconds_total")
        spent = after[(cpu, ())] - before[(cpu, ())]
        heard = after[(audio, ())] - before[(audio, ())]
        lag_s, n_s = p99(after, "omni_session_loop_lag_seconds")
        lag_r, n_r = p99(metrics(router_port), "omni_router_loop_lag_seconds")
        print(f"{sessions} sessions x {seconds:g} s in real time: sessions loop lag p99 <= {lag_s * 1000:g} ms ({n_s} ticks), "
              f"router <= {lag_r * 1000:g} ms ({n_r}); turn detection {spent * 1000 / heard:.1f} ms CPU per s of audio "
              f"(detection thread), {heard:.0f} s heard")


if __name__ == "__main__":
    main(*(int(sys.argv[1]),) if len(sys.argv) > 1 else (), *(float(a) for a in sys.argv[2:3]))
