"""The incremental vocoder decoder is exact for any reach: the tiny layout and the real window.

The real Qwen3-Omni vocoder (8 transformer layers, sliding window 72) looks back ~580 frames; a
25-frame left context cannot cover it (docs/qwen3-omni.md, "The vocoder"). Measured here (160
frames, generator seed 1) against the float64 forward (tests/audio_checks.py): tiny layout:
float32 forward 103.6 dB, incremental 103.3-104.5 dB at chunks 1, 4, 25; tiny widths with the
real reach: float32 forward 102.8 dB, incremental 102.2-103.9 dB, left-context re-decoding
4.8 dB (chunk 25). The real widths: test_real_width.py.
"""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch

from services.code2wav.blocks import Block, BlockGrid, StreamDecoder
from services.code2wav.incremental import IncrementalVocoder, _TransConv
from services.code2wav.vocoder import decode_full, measure_geometry
from services.code2wav.window import WindowVocoder
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import GraphSettings
from tests.audio_checks import check_streamed_audio, snr_db

REAL_REACH = {"code2wav_config": {"num_hidden_layers": 8, "sliding_window": 72}}
FRAMES = 160


@pytest.fixture(scope="module")
def vocoders(tiny_checkpoint, tmp_path_factory):
    import transformers

    from services.tools.tiny_checkpoint import build

    transformers.logging.set_verbosity_error()
    real_reach = build(tmp_path_factory.mktemp("ckpt") / "tiny-real-reach", seed=0, layout=REAL_REACH)
    return {name: load_stage(path, Stage.CODE2WAV).model
            for name, path in (("tiny", tiny_checkpoint), ("real-reach", real_reach))}


def incremental(model, sizes: tuple[int, ...] = (4,)) -> StreamDecoder:
    return StreamDecoder(IncrementalVocoder(model, measure_geometry(model), BlockGrid(sizes)))


def stream(decoder, frames: torch.Tensor, chunk: int) -> np.ndarray:
    out = [decoder.push(frames[s:s + chunk]) for s in range(0, frames.shape[0], chunk)]
    return np.concatenate(out + [decoder.finish()])


@pytest.mark.parametrize("layout", ["tiny", "real-reach"])
@pytest.mark.parametrize("chunk", [1, 4, 25])
def test_incremental_decoding_equals_one_forward(vocoders, layout, chunk):
    model = vocoders[layout]
    frames = torch.randint(0, 64, (FRAMES, 16), generator=torch.Generator().manual_seed(1))
    streamed = stream(incremental(model), frames, chunk)
    check_streamed_audio(model, frames, streamed)


def test_left_context_re_decoding_cannot_cover_the_real_reach(vocoders):
    model = vocoders["real-reach"]
    frames = torch.randint(0, 64, (FRAMES, 16), generator=torch.Generator().manual_seed(1))
    reference = decode_full(model, frames)
    windowed = stream(StreamDecoder(WindowVocoder(model, measure_geometry(model), BlockGrid((25,)), 25)), frames, 25)
    assert snr_db(reference, windowed) < 30  # why incremental is the default decoder


def test_each_frame_is_convolved_once(vocoders):
    # Every convolution keeps its own history, so the stack sees each frame once, not a left
    # context again before every chunk (what the decoder did before: 1.6x the work for 64 frames).
    model = vocoders["tiny"]
    decoder = incremental(model)
    first = decoder.vocoder._stack.layers[0].layers[0].layers[0]  # the first layer after the transformer
    assert isinstance(first, _TransConv) and first.conv.keywords["weight"] is model.upsample[0][0].conv.weight
    seen, conv = [], first.conv
    first.conv = lambda x: seen.append(x.shape[-1]) or conv(x)
    frames = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(2))
    streamed = stream(decoder, frames, 4)
    assert seen == [4] * 16
    check_streamed_audio(model, frames, streamed)


def test_the_state_is_a_slot_updated_in_place_and_given_back(vocoders):
    # A request's state is its row of the pool (the transformer's key buffers and every
    # convolution's history): a whole block writes it in place, an open block leaves it, nothing is
    # copied per request, and a dropped request's slot goes to the next one.
    model = vocoders["tiny"]
    decoder = incremental(model)
    pool = decoder.vocoder._pool
    tensor, slot = pool.tensor, decoder.state.index
    assert pool.width == sum(math.prod(shape) for _, shape in pool.spans) and len(pool.spans) > 20
    frames = torch.randint(0, 64, (29, 16), generator=torch.Generator().manual_seed(3))
    decoder.push(frames[:4])
    after_first = tensor[slot].clone()
    assert after_first.abs().sum() > 0
    decoder.push(frames[4:7])  # the second block open: its state is not kept
    assert torch.equal(tensor[slot], after_first) and not torch.equal(tensor[pool.scratch], torch.zeros_like(after_first))
    decoder.push(frames[7:])
    assert pool.tensor is tensor and not torch.equal(tensor[slot], after_first)
    copy = decoder.vocoder.fork(decoder.state)
    assert copy.index != slot and torch.equal(tensor[copy.index], tensor[slot])
    vocoder = IncrementalVocoder(model, measure_geometry(model), BlockGrid((4,)), slots=2)
    first, second = vocoder.start(), vocoder.start()
    assert (first.index, second.index, vocoder._pool.capacity) == (0, 1, 2)
    second_row = vocoder._pool.tensor[1].fill_(7.0).clone()
    del first
    again = vocoder.start()
    assert again.index == 0 and vocoder._pool.capacity == 2
    more = vocoder.start()  # full: the pool doubles, the rows of its slots kept
    assert (more.index, vocoder._pool.capacity, vocoder._pool.tensor.shape[0]) == (2, 4, 5)  # and a scratch row
    assert torch.equal(vocoder._pool.tensor[second.index], second_row)


def test_a_batch_above_the_largest_graph_bucket_decodes_eagerly_logged_once(vocoders, caplog):
    # No capture on a CPU: a batch no bucket holds never reaches one, and decodes batched.
    model = vocoders["tiny"]
    geometry, grid = measure_geometry(model), BlockGrid((4,))
    frames = [torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    eager = IncrementalVocoder(model, geometry, grid)
    bucketed = IncrementalVocoder(model, geometry, grid, GraphSettings(enabled=True, buckets=(1, 2)))
    wav = {}
    with caplog.at_level(logging.WARNING, logger="services.code2wav.incremental"):
        for vocoder in (eager, bucketed):
            slots = [vocoder.start() for _ in frames]
            wav[vocoder] = [vocoder.decode([Block(i, 4 * i, f[4 * i:4 * i + 4], 4, f[:0]) for f in frames], slots)[0]
                            for i in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(wav[eager], wav[bucketed]))
    assert caplog.text.count("above the largest CUDA graph bucket (2)") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replays_give_the_eager_audio_and_the_state_advances_in_place(vocoders):
    # On the GPU: blocks replayed from graphs (padded to buckets 1, 2, 4) against the same blocks
    # decoded eagerly, 3 requests with the grid's every shape; TF32 off (cuDNN and cuBLAS pick
    # their algorithms by batch size, so a padded replay is compared within float32 rounding).
    model = copy.deepcopy(vocoders["tiny"]).cuda()
    geometry, grid = measure_geometry(model), BlockGrid((4, 8, 16, 25))
    graphed = IncrementalVocoder(model, geometry, grid, GraphSettings(enabled=True, buckets=(1, 2, 4)))
    graphed.capture(3)
    eager = IncrementalVocoder(model, geometry, grid)
    frames = [torch.randint(0, 64, (80, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    audio = {}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for vocoder in (graphed, eager):
            slots = [vocoder.start() for _ in frames]
            audio[vocoder] = []
            for index in range(5):
                start, size = grid.first_frame(index), grid.size(index)
                blocks = [Block(index, start, f[start:start + size], size, f[:0]) for f in frames]
                audio[vocoder].append(vocoder.decode(blocks, slots)[0])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
    for replayed, alone in zip(audio[graphed], audio[eager]):
        assert replayed.device.type == "cpu" and torch.allclose(replayed, alone, atol=1e-5)
    runners = graphed._runners.values()
    assert sum(r.stats.replays for r in runners) == 5 and all(r.stats.failed is None for r in runners)
