"""bfloat16 end to end on CPU: the thinker, talker and code2wav engines on the tiny checkpoint
loaded in bfloat16 produce whole frames of valid codes and audible audio, with no dtype errors.

The same code runs on `--device cuda --dtype bfloat16`; what CPU cannot check (speed, CUDA
kernels) is bench/device_check.sh's job. Not compared with float32: bf16 greedy decoding of
random weights legitimately picks other tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.base.finish import FinishReason
from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import (
    Audio,
    CodecChunk,
    CodecEnd,
    Decoded,
)
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.tools.reference import messages_from_args
from tests.gpu.harness import run_pipeline

THINKER_TOKENS = 5
TALKER_TOKENS = 7  # -> 6 frames


@pytest.fixture(scope="module")
def bf16(tiny_checkpoint):
    return {stage: load_stage(tiny_checkpoint, stage, dtype="bfloat16") for stage in Stage}


@pytest.fixture(scope="module")
def requests(wav_file) -> dict:
    return {
        "text": (messages_from_args("Hello! How are you?", None, None, None), THINKER_TOKENS, TALKER_TOKENS),
        "audio": (messages_from_args("What do you hear?", None, wav_file, None), THINKER_TOKENS, TALKER_TOKENS),
    }


def engines(thinker_stage, talker_stage):
    cfg = dict(max_batch_size=4, num_slots=4, max_model_len=128, exact_batching=False)
    return (ThinkerEngine(thinker_stage.model, thinker_stage.config, engine_config=ThinkerEngineConfig(**cfg)),
            TalkerEngine(talker_stage.model, talker_stage.config, engine_config=TalkerEngineConfig(**cfg)))


def assert_whole_valid_frames(config, tokens, frames, done, requests) -> None:
    codebook = config.code2wav_config.codebook_size
    groups = config.talker_config.num_code_groups
    for rid, (_, max_new, talker_max) in requests.items():
        assert len(tokens[rid]) == max_new, rid
        assert done[rid].reason is FinishReason.LENGTH, rid
        assert len(frames[rid]) == done[rid].frames == talker_max - 1, rid
        codes = torch.stack(frames[rid])  # [frames, groups]
        assert codes.dtype == torch.int64 and codes.shape[1] == groups
        assert int(codes.min()) >= 0 and int(codes.max()) < codebook, rid


def test_bf16_thinker_and_talker_make_whole_frames_of_valid_codes(bf16, tiny_checkpoint, requests):
    thinker, talker = engines(bf16[Stage.THINKER], bf16[Stage.TALKER])
    # Caches are allocated once, in the model's dtype.
    assert thinker.cache.keys[0].dtype == talker.cache.keys[0].dtype == torch.bfloat16
    assert talker.predictor_cache.keys[0].dtype == torch.bfloat16
    config = bf16[Stage.THINKER].config
    tokens, frames, done = run_pipeline(thinker, talker, PromptBuilder(tiny_checkpoint, config), config, requests)
    assert_whole_valid_frames(config, tokens, frames, done, requests)


def test_bf16_talker_takes_float32_thinker_tensors(bf16, tiny_checkpoint, requests):
    """A float32 thinker feeds a bfloat16 talker: prompt embeddings, multimodal hidden states,
    tts embeddings and text rows arrive as float32 and are cast to the talker's dtype."""
    fp32_thinker = load_stage(tiny_checkpoint, Stage.THINKER)
    thinker, talker = engines(fp32_thinker, bf16[Stage.TALKER])
    config = fp32_thinker.config
    tokens, frames, done = run_pipeline(thinker, talker, PromptBuilder(tiny_checkpoint, config), config,
                                        {"audio": requests["audio"]})
    assert_whole_valid_frames(config, tokens, frames, done, {"audio": requests["audio"]})


@pytest.mark.slow  # 9 s of bf16 code2wav on the CPU: make test-slow (CI)
def test_bf16_code2wav_streams_finite_audible_audio(bf16):
    config = bf16[Stage.CODE2WAV].config
    engine = Qwen3Code2WavAdapter(bf16[Stage.CODE2WAV], Code2WavConfig(serving=ServingConfig(),
                                                                       model=ModelConfig(checkpoint="unused"))).build_engine()
    codebook, groups = config.code2wav_config.codebook_size, config.code2wav_config.num_quantizers
    frames = torch.randint(0, codebook, (33, groups), generator=torch.Generator().manual_seed(0))
    engine.add("r")
    for chunk in (frames[:4], frames[4:29], frames[29:]):
        engine.add_input("r", CodecChunk(chunk))
    engine.add_input("r", CodecEnd())
    audio, decoded = [], None
    while engine.has_work():
        for _, event in engine.step():
            if isinstance(event, Audio):
                assert event.samples.dtype == np.float32
                audio.append(event.samples)
            elif isinstance(event, Decoded):
                decoded = event
    wav = np.concatenate(audio)
    g = engine.geometry
    assert decoded is not None and wav.size == decoded.samples == 33 * g.samples_per_frame - g.lookahead_samples
    assert np.isfinite(wav).all()
    assert float(np.sqrt(np.mean(wav ** 2))) > 1e-2  # audible, not the near-silent default init
