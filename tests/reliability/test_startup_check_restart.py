"""A code2wav process serves as soon as its weights are loaded, while exact mode's check runs beside
it at the lowest priority (services/runtime/checks.py): drained (SIGTERM) during the check it exits
cleanly, and it restarts
and serves at once, its audio exact from the first request; once the check ends its verdict is kept
and the next start adopts it before serving.

To hold the check running for as long as the test needs, the process is pinned to one CPU beside a
busy process at the normal priority (`--light-load-cpus`): the check's thread, at nice 19, then
gets about 1.5 % of that CPU, and the engine's thread half of it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.code2wav.blocks import BlockGrid, StreamDecoder
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.vocoder import measure_geometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import Stage, load_stage
from services.serving.wire import audio_from_proto, frames_to_proto
from services.tools.launcher import Stack, StackOptions, free_port
from tests.threads import torch_threads


def check_state(metrics_port: int) -> str:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "omni_exact_check":
            return next(s.labels["omni_exact_check"] for s in family.samples if s.value == 1)
    raise AssertionError("omni_exact_check is not exported")


def decode(port: int, frames: torch.Tensor) -> np.ndarray:
    def inputs():
        yield stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id="r"))
        for first in range(0, frames.shape[0], 7):
            yield stages_pb2.Code2WavInput(frames=frames_to_proto(frames[first:first + 7], first))
        yield stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        outputs = list(stages_pb2_grpc.Code2WavStub(channel).Decode(inputs(), timeout=120))
    return np.concatenate([audio_from_proto(o.audio) for o in outputs if o.HasField("audio")])


@pytest.mark.slow  # ~20 s: a process started three times
def test_a_code2wav_killed_during_its_check_serves_again_at_once_then_keeps_the_verdict(tiny_checkpoint, tmp_path):
    vocoder = load_stage(tiny_checkpoint, Stage.CODE2WAV).model
    frames = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(11))
    threads, previous = torch_threads(1), torch.get_num_threads()
    torch.set_num_threads(threads)  # the stage's count: a kernel's bits follow it
    try:
        alone = StreamDecoder(IncrementalVocoder(vocoder, measure_geometry(vocoder),
                                                 BlockGrid(DEFAULT_CHUNKS.schedule()))).push(frames)
    finally:
        torch.set_num_threads(previous)
    hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
    metrics = free_port()
    stack = Stack(StackOptions(checkpoint=str(tiny_checkpoint), port=0, log_prefix=False, startup_timeout_s=120))
    cache = tmp_path / "checks"
    args = ["--checkpoint", str(tiny_checkpoint), "--host", "127.0.0.1", "--threads", str(threads), "--light-load-cpus", "0",
            "--metrics-port", str(metrics), "--check-cache", str(cache), "--max-batch", "64"]
    try:
        process = stack._add("code2wav-0", Stage.CODE2WAV, args)
        stack.wait_ready("code2wav-0")
        assert check_state(metrics) == "running"  # serving before its check ended
        assert np.array_equal(decode(process.port, frames), alone)
        stack.kill("code2wav-0", signal.SIGTERM)  # drained during its check: the check stops, the exit is clean
        assert process.popen.wait(timeout=60) == 0  # it aborted in torch: "terminate called without an active exception"
        assert not list(cache.glob("*.json"))  # a check cut short keeps nothing
        stack.restart("code2wav-0")
        assert check_state(metrics) == "running"
        assert np.array_equal(decode(process.port, frames), alone)
        hog.kill()
        deadline = time.monotonic() + 120
        while (state := check_state(metrics)) == "running":
            assert time.monotonic() < deadline, "the check never ended"
            time.sleep(0.2)
        assert state == "checked" and len(list(cache.glob("code2wav-blocks-*.json"))) == 1
        assert np.array_equal(decode(process.port, frames), alone)
        stack.kill("code2wav-0")
        process.popen.wait(timeout=30)
        stack.restart("code2wav-0")
        assert check_state(metrics) == "cached"  # the same machine and shapes: adopted before serving
    finally:
        hog.kill()
        stack.stop()
