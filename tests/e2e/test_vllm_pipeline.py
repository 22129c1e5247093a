"""With the vLLM thinker backend, the whole pipeline still equals transformers' generate.

Needs the optional vLLM install (`make setup-vllm`; run with `make test-vllm`); skipped without it.
vLLM's CPU attention needs head_dim >= 32, so this builds the tiny checkpoint with a thinker
head_dim of 32 (tests/thinker/test_vllm_backend.py explains).
"""

from __future__ import annotations

import pytest

from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.thinker.vllm_backend import TINY_LAYOUT_FOR_VLLM_CPU, vllm_available
from services.tools.client import build_request, collect, connect
from tests.stacks import stack_of

VLLM_OK, VLLM_DETAIL = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.exactness, pytest.mark.skipif(
    not VLLM_OK, reason=f"vLLM is not importable here ({VLLM_DETAIL}); run `make test-vllm`")]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    from services.tools.tiny_checkpoint import build

    checkpoint = build(tmp_path_factory.mktemp("ckpt") / "tiny-hd32", seed=0, layout=TINY_LAYOUT_FOR_VLLM_CPU)
    with stack_of(checkpoint, thinker_args=("--backend", "vllm")) as stack:
        yield stack, checkpoint


@pytest.mark.parametrize("case", ["text", "audio"])
def test_pipeline_with_the_vllm_thinker_equals_generate(vllm_stack, case, wav_bytes):
    import transformers

    from services.tools.reference import ReferenceRunner

    stack, checkpoint = vllm_stack
    audio = wav_bytes if case == "audio" else None
    transformers.logging.set_verbosity_error()
    parts = ((Part(audio=audio),) if audio else ()) + (Part(text="Hello! What do you hear?"),)
    expected = ReferenceRunner(checkpoint).generate([ChatMessage(Role.USER, parts)], voice="aiden",
                                                    max_new_tokens=10, talker_max_new_tokens=30)
    channel, stub = connect(stack.target)
    with channel:
        got = collect(stub, build_request("Hello! What do you hear?", audio=audio, voice="aiden", max_new_tokens=10,
                                          talker_max_new_tokens=30, return_codec_frames=True), timeout=300)
    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.codec_frames == expected.codec_frames and len(got.codec_frames) == 29
    assert got.audio.shape == expected.audio.shape
