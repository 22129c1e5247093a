"""The vLLM thinker backend equals the transformers engine and the reference (greedy, tiny checkpoint).

Tests marked `vllm` need vLLM (the vllm extra: requirements-vllm.txt) and are skipped, with the
reason, when it does not import; run them with `<vllm venv>/bin/python -m pytest
tests/thinker/test_vllm_backend.py`. The rest check the conversions without vLLM.

vLLM's CPU attention has no kernel for head_dim 16 (the tiny checkpoint's), so the vLLM tests use
the same tiny checkpoint with a thinker head_dim of 32 (its mrope sections scaled to fit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.runtime.lm.sampling import SamplingConfig
from services.thinker.engine import Finished, Prefilled, ThinkerJob, Token
from services.thinker.vllm_backend import (
    MEDIA_KEY,
    TINY_LAYOUT_FOR_VLLM_CPU,
    build_prompt,
    collapse_placeholders,
    hf_overrides,
    load_embedding_table,
    pad_audio,
    vllm_available,
    vllm_prompt,
)

VLLM_OK, VLLM_DETAIL = vllm_available()
needs_vllm = pytest.mark.skipif(not VLLM_OK, reason=f"vLLM is not importable here ({VLLM_DETAIL}); "
                                                    "install requirements-vllm.txt (see its header)")

MAX_NEW = 12


def user_turn(prompt: str, audio: bytes | None = None, image: bytes | None = None) -> list[ChatMessage]:
    parts = [Part(audio=audio)] if audio else []
    parts += [Part(image=image)] if image else []
    return [ChatMessage(Role.SYSTEM, (Part(text="Answer briefly."),)),
            ChatMessage(Role.USER, tuple(parts) + (Part(text=prompt),))]


def run_to_end(engine, jobs: dict[str, ThinkerJob], max_steps: int = 10_000) -> dict[str, list]:
    """Add every job at once, step until the engine is idle; request_id -> its events in order."""
    events: dict[str, list] = {request_id: [] for request_id in jobs}
    for request_id, job in jobs.items():
        engine.add(request_id, job)
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        for request_id, event in engine.step():
            events[request_id].append(event)
    raise AssertionError("engine did not finish")


def token_ids(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, Token)]


# Without vLLM: the prompt conversion and the talker-input sources.

def test_collapse_placeholders_keeps_one_token_per_run():
    assert collapse_placeholders([1, 5, 5, 5, 4, 8, 8, 7, 5, 5], {5, 8}) == [1, 5, 4, 8, 7, 5]
    assert collapse_placeholders([3, 3, 1], {5}) == [3, 3, 1]


def test_vllm_prompt_collapses_media_runs_and_carries_the_raw_media(tiny_checkpoint, wav_bytes, png_bytes):
    from services.runtime.inputs.prompt import PromptBuilder
    from services.runtime.model.checkpoint import load_config

    config = load_config(tiny_checkpoint)
    messages = user_turn("Describe.", audio=wav_bytes, image=png_bytes)
    prompt = PromptBuilder(tiny_checkpoint, config).build(messages)
    mm = config.thinker_config
    with pytest.raises(ValueError, match="build_prompt"):
        vllm_prompt(prompt, mm.audio_token_id, mm.image_token_id)
    prompt = build_prompt(PromptBuilder(tiny_checkpoint, config), messages)
    out = vllm_prompt(prompt, mm.audio_token_id, mm.image_token_id)
    ids = out["prompt_token_ids"]
    assert ids.count(mm.audio_token_id) == 1 and ids.count(mm.image_token_id) == 1
    assert len(ids) < prompt.num_tokens
    (audio, rate), = out["multi_modal_data"]["audio"]
    assert rate == 16000 and audio.dtype == np.float32 and audio.shape == (16000,)
    assert out["multi_modal_data"]["image"] == list(prompt.extra[MEDIA_KEY].images)


def wav(samples: int, rate: int = 16000) -> bytes:
    import io

    import soundfile as sf

    t = np.arange(samples) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_pad_audio_appends_silence_up_to_a_whole_hop():
    from services.runtime.inputs.prompt import decode_audio

    messages = user_turn("hi", audio=wav(16080))
    padded = pad_audio(messages, 160)[1].parts[0]
    original, got = decode_audio(messages[1].parts[0].audio, "a"), decode_audio(padded.audio, "a")
    assert got.shape == (16160,)
    assert np.array_equal(got[:16080], original) and not got[16080:].any()
    assert pad_audio(user_turn("hi", audio=wav(16000)), 160)[1].parts[0].audio == wav(16000)


def test_hf_overrides_fill_only_the_keys_vllm_needs(tiny_checkpoint):
    over = hf_overrides(tiny_checkpoint)["thinker_config"]
    # patch 16 x sqrt(256 learned positions) = 256 pixels
    assert over["vision_config"] == {"image_size": 256, "apply_vit_abs_pos_embed": True}
    assert over["text_config"] == {"tie_word_embeddings": False}


def test_embedding_table_from_safetensors_equals_the_loaded_thinker(tiny_checkpoint):
    from services.runtime.model.checkpoint import Stage, load_stage

    model = load_stage(tiny_checkpoint, Stage.THINKER).model
    table = load_embedding_table(tiny_checkpoint, torch.float32)
    assert torch.equal(table, model.get_input_embeddings().weight)


# With vLLM.

# The tiny checkpoint with thinker head_dim 32, which vLLM's CPU attention supports.
HEAD_DIM_32 = TINY_LAYOUT_FOR_VLLM_CPU


@pytest.fixture(scope="module")
def vllm_checkpoint(tmp_path_factory):
    from services.tools.tiny_checkpoint import build

    return build(tmp_path_factory.mktemp("ckpt") / "tiny-hd32", seed=0, layout=HEAD_DIM_32)


@pytest.fixture(scope="module")
def backends(vllm_checkpoint):
    """(vLLM engine, transformers engine, prompt builder, reference runner) on that checkpoint."""
    import transformers

    from services.runtime.inputs.prompt import PromptBuilder
    from services.runtime.model.checkpoint import Stage, load_stage
    from services.thinker.engine import ThinkerEngine
    from services.thinker.vllm_backend import VllmThinkerConfig, VllmThinkerEngine
    from services.tools.reference import ReferenceRunner

    transformers.logging.set_verbosity_error()
    loaded = load_stage(vllm_checkpoint, Stage.THINKER)
    hf = ThinkerEngine(loaded.model, loaded.config)
    # In-process engine core and a 64 MiB KV cache (4096 tokens of this model): quick to start.
    vllm = VllmThinkerEngine(VllmThinkerConfig(checkpoint=str(vllm_checkpoint), max_num_seqs=8,
                                               max_model_len=1024, kv_cache_bytes=64 << 20, multiprocess=False))
    yield vllm, hf, PromptBuilder(vllm_checkpoint, loaded.config), ReferenceRunner(vllm_checkpoint)
    vllm.close()


def job_for(prompts, messages, talker: bool, max_new: int = MAX_NEW) -> ThinkerJob:
    return ThinkerJob(build_prompt(prompts, messages), SamplingConfig(max_new_tokens=max_new),
                      want_talker_inputs=talker)


@pytest.fixture(scope="module")
def cases(wav_bytes, png_bytes):
    return {
        "text": user_turn("Hello! How are you today?"),
        "audio": user_turn("What do you hear?", audio=wav_bytes),
        "image": user_turn("Describe the picture.", image=png_bytes),
        "audio+image": user_turn("Tell me about both.", audio=wav_bytes, image=png_bytes),
        # 16080 samples: vLLM would count one audio token more unless padded (build_prompt)
        "odd-length audio": user_turn("And this?", audio=wav(16080)),
    }


@pytest.mark.exactness
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("case", ["text", "audio", "image", "audio+image", "odd-length audio"])
def test_greedy_ids_equal_transformers_engine_and_reference(backends, cases, case):
    vllm, hf, prompts, reference = backends
    messages = pad_audio(cases[case], 160)  # what build_prompt hands both engines; the reference too
    got = token_ids(run_to_end(vllm, {"r": job_for(prompts, messages, talker=False)})["r"])
    want_engine = token_ids(run_to_end(hf, {"r": job_for(prompts, messages, talker=False)})["r"])
    want_reference = reference.generate(messages, max_new_tokens=MAX_NEW, return_audio=False).thinker_token_ids
    assert got == want_engine == want_reference
    assert len(got) == MAX_NEW  # random weights: no end token, every request runs to its limit


@pytest.mark.exactness
@pytest.mark.vllm
@needs_vllm
def test_concurrent_requests_each_equal_the_transformers_engine(backends, cases):
    vllm, hf, prompts, _ = backends
    jobs = {f"{case}-{i}": job_for(prompts, cases[case], talker=False, max_new=MAX_NEW + 3 * i)
            for i, case in enumerate(cases)}  # different lengths: requests join and leave the batch
    got = run_to_end(vllm, jobs)
    want = run_to_end(hf, {request_id: job_for(prompts, cases[request_id.rsplit("-", 1)[0]], talker=False,
                                               max_new=job.sampling.max_new_tokens)
                           for request_id, job in jobs.items()})
    for request_id in jobs:
        assert token_ids(got[request_id]) == token_ids(want[request_id]), request_id


@pytest.mark.exactness
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("case", ["text", "audio+image"])
def test_talker_inputs_equal_the_transformers_engine(backends, cases, case):
    """Equal talker inputs give equal codec frames: the talker is a function of these tensors."""
    vllm, hf, prompts, _ = backends
    got = run_to_end(vllm, {"r": job_for(prompts, cases[case], talker=True)})["r"]
    want = run_to_end(hf, {"r": job_for(prompts, cases[case], talker=True)})["r"]
    assert [type(e) for e in got] == [Prefilled] + [Token] * MAX_NEW + [Finished]
    assert [type(e) for e in got] == [type(e) for e in want]
    g, w = got[0], want[0]
    assert g.prompt_token_ids == w.prompt_token_ids
    assert g.multimodal_positions == w.multimodal_positions
    assert (len(g.multimodal_positions) > 0) == (case != "text")
    for name in ("prompt_embeds", "multimodal_hidden", "tts_embeds"):
        assert torch.equal(getattr(g, name), getattr(w, name)), name
    for gt, wt in zip(got[1:-1], want[1:-1]):
        assert (gt.token_id, gt.index, gt.last) == (wt.token_id, wt.index, wt.last)
        assert torch.equal(gt.embedding, wt.embedding)
    assert got[-1] == want[-1]


@pytest.mark.vllm
@needs_vllm
def test_abort_ends_a_request_and_the_engine_serves_the_next(backends, cases):
    vllm, hf, prompts, _ = backends
    vllm.add("gone", job_for(prompts, cases["text"], talker=False, max_new=200))
    while not any(isinstance(e, Token) for _, e in vllm.step()):
        pass
    vllm.abort("gone")
    assert not vllm.has_work() and vllm.queue_depth == 0 and vllm.running == 0
    got = token_ids(run_to_end(vllm, {"next": job_for(prompts, cases["text"], talker=False)})["next"])
    want = token_ids(run_to_end(hf, {"next": job_for(prompts, cases["text"], talker=False)})["next"])
    assert got == want

