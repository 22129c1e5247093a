"""Figures: docs/sessions.md, "What turn detection costs" (health checks while a 1 MiB append lands).
Rerun: `.venv/bin/python -m bench.probes.append_health [checkpoint]` (default models/tiny-qwen3-omni).

The stack on the checkpoint with its gateway (its sessions service without the input bound, so the
append is taken, not refused); a session with turn detection on (pcm16 at 24 kHz) gets one 1 MiB
append (about 22 s of audio) while threads check the router's and the sessions service's
grpc.health.v1 and the gateway's /health every 10 ms; the slowest check of each while the append
is handled, three times over gRPC, then three times through the gateway's WebSocket (the append
as the Realtime API's base64 event, 1.4 MB of JSON).
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.tools.launcher import Stack, StackOptions


def poll(target: str, took: list[float], stop: threading.Event) -> None:
    """Check `target` every 10 ms until `stop` (grpc.health.v1 at an address, or GET of an http URL);
    each check's time into `took`."""
    with contextlib.ExitStack() as resources:
        if target.startswith("http"):
            def check():
                urllib.request.urlopen(target, timeout=10).read()
        else:
            stub = health_pb2_grpc.HealthStub(resources.enter_context(grpc.insecure_channel(target)))

            def check():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        while not stop.is_set():
            start = time.perf_counter()
            check()
            took.append(time.perf_counter() - start)
            time.sleep(0.01)


def checked_while(land, checks: dict) -> str:
    """`land()` (returns once the append was handled) while every check polls; what each saw."""
    took, stop = {name: [] for name in checks}, threading.Event()
    pollers = [threading.Thread(target=poll, args=(target, took[name], stop))
               for name, target in checks.items()]
    for thread in pollers:
        thread.start()
    time.sleep(0.3)
    start = time.perf_counter()
    land()
    handled = time.perf_counter() - start
    time.sleep(0.3)
    stop.set()
    for thread in pollers:
        thread.join()
    return (f"append handled in {handled * 1000:.0f} ms; slowest health check: "
            + ", ".join(f"{name} {max(t) * 1000:.1f} ms" for name, t in took.items()))


def one_append(stack: Stack, audio: bytes) -> str:
    requests: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(stack.sessions_target)
    call = omni_pb2_grpc.SessionsStub(channel).Session(iter(requests.get, None))
    requests.put(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(
        input_format=omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=24000),
        turn_detection=omni_pb2.TurnDetection(create_response=False))))
    next(call), next(call)  # created, updated

    def land() -> None:
        requests.put(omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=audio)))
        requests.put(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(instructions="x")))  # answered after it
        for event in call:
            if event.WhichOneof("event") == "updated":
                break

    try:
        return "grpc: " + checked_while(land, {"router": stack.target, "sessions service": stack.sessions_target})
    finally:
        requests.put(None)
        call.cancel()
        channel.close()


def one_websocket_append(stack: Stack, audio: bytes) -> str:
    from websockets.sync.client import connect

    def until(ws, kind: str) -> None:
        while json.loads(ws.recv())["type"] != kind:
            pass

    with connect(stack.http_url.replace("http://", "ws://") + "/v1/realtime?model=probe", max_size=None) as ws:
        until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False}}}}}))
        until(ws, "session.updated")
        append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()})

        def land() -> None:
            ws.send(append)
            ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "x"}}))
            until(ws, "session.updated")  # answered after the append

        return "websocket: " + checked_while(land, {"router": stack.target, "gateway": f"{stack.http_url}/health"})


def main(checkpoint: str = "models/tiny-qwen3-omni") -> None:
    audio = (np.random.default_rng(0).standard_normal(1 << 19) * 3000).astype("<i2").tobytes()  # 1 MiB
    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, http_port=0,
                           sessions_args=("--max-input-realtime", "0"))
    with Stack(options) as stack:
        for probe in (one_append, one_websocket_append):
            for _ in range(3):
                print(probe(stack, audio), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
