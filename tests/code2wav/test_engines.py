"""Qwen3-Omni's code2wav engine with its two decoders, as the family adapter builds it (services/
code2wav/qwen3_adapter.py): `--decoder` picks the vocoder once, and both give each of several
interleaved streams one vocoder forward of its own frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.base.errors import UserError
from services.code2wav.config import Code2WavConfig, Decoder
from services.code2wav.engine import Audio, CodecChunk, CodecEnd, Decoded
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.server import adapter_for, build_parser, config_from_args
from services.code2wav.window import WindowVocoder
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from tests.audio_checks import check_streamed_audio

VOCODERS = {Decoder.INCREMENTAL: IncrementalVocoder, Decoder.WINDOW: WindowVocoder}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.CODE2WAV)


def engine_for(loaded, tiny_checkpoint, decoder: Decoder):
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint=str(tiny_checkpoint)), decoder=decoder)
    return adapter_for(loaded, config).build_engine()


@pytest.mark.parametrize("decoder", list(Decoder))
def test_the_decoder_flag_picks_its_engine(loaded, tiny_checkpoint, decoder):
    config = config_from_args(build_parser().parse_args(["--checkpoint", str(tiny_checkpoint), "--decoder", decoder]))
    assert config.decoder is decoder
    engine = engine_for(loaded, tiny_checkpoint, config.decoder)
    assert type(engine.vocoder) is VOCODERS[decoder]
    # CPU: eager forwards (the window vocoder's CUDA graphs would be Code2WavGraphs.decode).
    assert getattr(getattr(engine.vocoder, "forward_windows", None), "__self__", None) is None


@pytest.mark.parametrize("decoder", list(Decoder))
def test_interleaved_streams_each_equal_one_vocoder_forward(loaded, tiny_checkpoint, decoder):
    engine = engine_for(loaded, tiny_checkpoint, decoder)
    lengths = {"a": 33, "b": 29, "c": 4}  # their blocks meet in equal shapes (the engine batches them)
    frames = {r: torch.randint(0, engine.codebook_size, (n, engine.num_quantizers),
                               generator=torch.Generator().manual_seed(i)) for i, (r, n) in enumerate(lengths.items())}
    for request_id in lengths:
        engine.add(request_id)
    for start, end in ((0, 4), (4, 12), (12, 29), (29, 33)):
        for request_id, codes in frames.items():
            if start < codes.shape[0]:
                engine.add_input(request_id, CodecChunk(codes[start:end]))
    for request_id in lengths:
        engine.add_input(request_id, CodecEnd())
    audio: dict[str, list[np.ndarray]] = {r: [] for r in lengths}
    decoded: dict[str, Decoded] = {}
    while engine.has_work():
        for request_id, event in engine.step():
            if isinstance(event, Audio):
                assert event.first_sample == sum(a.size for a in audio[request_id])
                audio[request_id].append(event.samples)
            else:
                decoded[request_id] = event
    assert engine.running == 0 and set(decoded) == set(lengths)
    for request_id, codes in frames.items():
        wav = np.concatenate(audio[request_id])
        assert decoded[request_id] == Decoded(wav.size, codes.shape[0])
        # The window decoder rotates by window-relative positions: 2 dB of margin (test_window.py).
        check_streamed_audio(loaded.model, codes, wav, margin_db=2.0 if decoder is Decoder.WINDOW else 1.0)


def test_max_batch_is_64_on_cuda_and_16_elsewhere_unless_set():
    def max_batch(*argv: str) -> int:
        return config_from_args(build_parser().parse_args(["--checkpoint", "unused", *argv])).max_batch

    assert (max_batch(), max_batch("--device", "cuda"), max_batch("--device", "cuda", "--max-batch", "8")) == (16, 64, 8)
    with pytest.raises(UserError, match="--max-batch must be at least 1"):
        max_batch("--max-batch", "0")
