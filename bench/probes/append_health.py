"""Figures: docs/sessions.md, "What turn detection costs" (health checks while a 1 MiB append lands).
Rerun: `.venv/bin/python -m bench.probes.append_health [checkpoint]` (default models/tiny-qwen3-omni).

The stack on the checkpoint (its sessions service without the input bound, so the append is
taken, not refused); a session with turn detection on (pcm16 at 24 kHz) gets one 1 MiB append
(about 22 s of audio) while two threads check the router's and the sessions service's
grpc.health.v1 every 10 ms; the slowest check of each while the append is handled, three times.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.tools.launcher import Stack, StackOptions


def poll(target: str, took: list[float], stop: threading.Event) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            took.append(time.perf_counter() - start)
            time.sleep(0.01)


def one_append(stack: Stack, audio: bytes) -> str:
    requests: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(stack.sessions_target)
    call = omni_pb2_grpc.SessionsStub(channel).Session(iter(requests.get, None))
    requests.put(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(
        input_format=omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=24000),
        turn_detection=omni_pb2.TurnDetection(create_response=False))))
    next(call), next(call)  # created, updated
    router, sessions, stop = [], [], threading.Event()
    pollers = [threading.Thread(target=poll, args=(stack.target, router, stop)),
               threading.Thread(target=poll, args=(stack.sessions_target, sessions, stop))]
    for thread in pollers:
        thread.start()
    time.sleep(0.3)
    start = time.perf_counter()
    requests.put(omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=audio)))
    requests.put(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(instructions="x")))  # answered after it
    for event in call:
        if event.WhichOneof("event") == "updated":
            break
    handled = time.perf_counter() - start
    time.sleep(0.3)
    stop.set()
    for thread in pollers:
        thread.join()
    requests.put(None)
    call.cancel()
    channel.close()
    return (f"append handled in {handled * 1000:.0f} ms; slowest health check: router {max(router) * 1000:.1f} ms, "
            f"sessions service {max(sessions) * 1000:.1f} ms")


def main(checkpoint: str = "models/tiny-qwen3-omni") -> None:
    audio = (np.random.default_rng(0).standard_normal(1 << 19) * 3000).astype("<i2").tobytes()  # 1 MiB
    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, sessions_args=("--max-input-realtime", "0"))
    with Stack(options) as stack:
        for _ in range(3):
            print(one_append(stack, audio))


if __name__ == "__main__":
    main(*sys.argv[1:])
