"""The code2wav engine decodes the most due requests' blocks first (services/code2wav/engine.py,
the module note): a request not yet heard is due from when it arrived, a running one `delivery_ms`
before its listener's audio runs out. One request a step here (`--max-batch 1`), so the order shows.
An open block (frames short of its block) waits until its listener needs it."""

from __future__ import annotations

import time

import pytest
import torch

from services.code2wav.blocks import BlockGrid
from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import Audio, Code2WavEngine, CodecChunk
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import BlockPlan
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.code2wav.vocoder import measure_geometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig

SAMPLES_PER_FRAME, LOOKAHEAD, RATE = 1920, 555, 24000  # the tiny vocoder's geometry (the real one's)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.CODE2WAV)


def frames(n: int) -> CodecChunk:
    return CodecChunk(torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(n)))


def decoded_first(loaded, first_frames: int, wait_s: float, delivery_ms: float = 100.0) -> tuple[str, float]:
    """"a" is heard (its first chunk of `first_frames` frames decoded as far as it is due); `wait_s`
    later "b" arrives; both have a block waiting. Which does the next step decode? Returns it and
    the seconds of audio "a" had been sent."""
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"), max_batch=1,
                            delivery_ms=delivery_ms)
    engine = Qwen3Code2WavAdapter(loaded, config).build_engine()
    engine.add("a")
    engine.add_input("a", frames(first_frames))
    heard, samples = [], 0
    while engine.has_work():
        for request, event in engine.step():
            if isinstance(event, Audio):
                heard.append(request)
                samples += event.samples.size
    assert set(heard) == {"a"}
    time.sleep(wait_s)
    engine.add("b")
    engine.add_input("a", frames(8))
    engine.add_input("b", frames(4))
    (request, _), = engine.step()
    return request, samples / RATE


def test_a_new_request_s_first_chunk_goes_before_a_listener_with_audio_in_hand(loaded):
    # Of its 25 frames "a" was sent the blocks of 4 and 8 (the grid 4, 8, 16, 25, ...): 0.94 s of
    # audio, 0.84 s before it is due with the 100 ms delivery margin (measured: 0.82 s left when "b"
    # came). Its 13 further frames are an open block of 16, which waits until it is due (or whole,
    # where exact mode's check did not adopt open blocks); decoded at once, they would have given
    # "a" 1.98 s.
    first, in_hand = decoded_first(loaded, first_frames=25, wait_s=0)
    assert in_hand == (12 * SAMPLES_PER_FRAME - LOOKAHEAD) / RATE
    assert first == "b"


def test_a_listener_that_ran_dry_goes_before_a_request_that_arrived_after(loaded):
    # One frame is 57 ms of audio (1920 - 555 samples): 0.1 s later "a" has run dry, before "b" came.
    assert (SAMPLES_PER_FRAME - LOOKAHEAD) / RATE < 0.1
    assert decoded_first(loaded, first_frames=1, wait_s=0.1, delivery_ms=0)[0] == "a"


def test_a_listener_about_to_run_dry_on_the_way_up_goes_first(loaded):
    # 57 ms of audio in hand, but audio takes 100 ms to reach the listener: "a" is already due.
    assert decoded_first(loaded, first_frames=1, wait_s=0, delivery_ms=100)[0] == "a"


def test_an_open_block_is_decoded_when_its_listener_needs_it_not_when_it_arrives(loaded):
    """Bug pinned: Code2WavEngine._decodable decoding an open block at once (its deadline check
    dropped): every early cut of the talker would then cost a decode of a block it re-decodes
    later, and the audio would not wait for frames it could have had. A plan that decodes open
    blocks (as exact mode's check adopts where it matched, or without exact mode)."""
    grid = BlockGrid(DEFAULT_CHUNKS.schedule())  # 4, 8, 16, 25, ...
    vocoder = IncrementalVocoder(loaded.model, measure_geometry(loaded.model), grid)
    engine = Code2WavEngine(vocoder, BlockPlan(grid, (1,), open_blocks=True), loaded.config, delivery_ms=0)
    engine.add("a")
    engine.add_input("a", frames(4))  # the first block, whole: decoded at once
    (request, event), = engine.step()
    assert request == "a" and event.samples.size == 4 * SAMPLES_PER_FRAME - LOOKAHEAD  # 0.30 s in hand
    engine.add_input("a", frames(3))  # an open block of 8: due once those 0.30 s have played
    assert not engine.has_work() and engine.step() == []
    due_in = engine.wake_in()
    assert 0 < due_in <= (4 * SAMPLES_PER_FRAME - LOOKAHEAD) / RATE
    time.sleep(due_in)
    assert engine.has_work()
    (request, event), = engine.step()
    assert request == "a" and isinstance(event, Audio) and event.samples.size > 0
