"""The code2wav engine decodes the most due requests' blocks first (services/code2wav/engine.py,
the module note): a request not yet heard is due from when it arrived, a running one `delivery_ms`
before its listener's audio runs out. One request a step here (`--max-batch 1`), so the order shows."""

from __future__ import annotations

import time

import pytest
import torch

from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import Audio, CodecChunk
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.runtime.checkpoint import Stage, load_stage
from services.runtime.settings import ModelConfig
from services.serving.config import ServingConfig

SAMPLES_PER_FRAME, LOOKAHEAD, RATE = 1920, 555, 24000  # the tiny vocoder's geometry (the real one's)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.CODE2WAV)


def frames(n: int) -> CodecChunk:
    return CodecChunk(torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(n)))


def decoded_first(loaded, first_frames: int, wait_s: float, delivery_ms: float = 100.0) -> str:
    """"a" is heard (its first chunk of `first_frames` frames decoded); `wait_s` later "b" arrives;
    both have a block waiting. Which does the next step decode?"""
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"), max_batch=1,
                            delivery_ms=delivery_ms)
    engine = Qwen3Code2WavAdapter(loaded, config).build_engine()
    engine.add("a")
    engine.add_input("a", frames(first_frames))
    heard = []
    while engine.has_work():
        heard += [request for request, event in engine.step() if isinstance(event, Audio)]
    assert set(heard) == {"a"}
    time.sleep(wait_s)
    engine.add("b")
    engine.add_input("a", frames(8))
    engine.add_input("b", frames(4))
    (request, _), = engine.step()
    return request


def test_a_new_request_s_first_chunk_goes_before_a_listener_with_audio_in_hand(loaded):
    assert decoded_first(loaded, first_frames=25, wait_s=0) == "b"  # "a" has 1.98 s to play


def test_a_listener_that_ran_dry_goes_before_a_request_that_arrived_after(loaded):
    # One frame is 57 ms of audio (1920 - 555 samples): 0.1 s later "a" has run dry, before "b" came.
    assert (SAMPLES_PER_FRAME - LOOKAHEAD) / RATE < 0.1
    assert decoded_first(loaded, first_frames=1, wait_s=0.1, delivery_ms=0) == "a"


def test_a_listener_about_to_run_dry_on_the_way_up_goes_first(loaded):
    # 57 ms of audio in hand, but audio takes 100 ms to reach the listener: "a" is already due.
    assert decoded_first(loaded, first_frames=1, wait_s=0, delivery_ms=100) == "a"
