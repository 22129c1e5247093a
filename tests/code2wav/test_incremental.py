"""The incremental vocoder decoder is exact for any reach: the tiny layout and the real window.

The real Qwen3-Omni vocoder (8 transformer layers, sliding window 72) looks back ~580 frames; a
25-frame left context cannot cover it (docs/qwen3-omni.md, "The vocoder"). Measured here (160
frames, generator seed 1) against the float64 forward (tests/audio_checks.py): tiny layout:
float32 forward 103.6 dB, incremental 103.3-104.5 dB at chunks 1, 4, 25; tiny widths with the
real reach: float32 forward 102.8 dB, incremental 102.2-103.9 dB, left-context re-decoding
4.8 dB (chunk 25). The real widths: test_real_width.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.code2wav.blocks import BlockGrid, StreamDecoder
from services.code2wav.incremental import IncrementalVocoder, _TransConv
from services.code2wav.vocoder import decode_full, measure_geometry
from services.code2wav.window import WindowVocoder
from services.runtime.model.checkpoint import Stage, load_stage
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


def test_the_state_kept_between_blocks_is_the_histories_alone(vocoders):
    # Each history must own its few samples, not view the block it was cut from: at the real
    # widths a view kept 152 MiB of activations alive per request between chunks.
    model = vocoders["tiny"]
    decoder = incremental(model)
    frames = torch.randint(0, 64, (29, 16), generator=torch.Generator().manual_seed(3))
    decoder.push(frames[:4])
    decoder.push(frames[4:])
    assert len(decoder.state) > 20  # the transformer's key buffers and every convolution's history
    for history in decoder.state:
        assert history.untyped_storage().nbytes() == history.numel() * history.element_size()
