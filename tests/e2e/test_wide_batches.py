"""33 and 64 concurrent requests through the stack with `--exact-batching gemm` each get the text
ids, codec frames and audio they get alone, and `generate`'s through the same op (project issue 55).

The concurrency test runs 16 requests: below the 32-row step of AVX512's vectors, where the
talker's shared-expert gate gave rows other bits. Here the batches go past one and two such steps
(33, then 64 requests), every stage in the mode whose every op is exact by construction.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.client import build_request, collect, connect
from services.tools.reference import ReferenceRunner
from tests.stacks import stack_of

# slow: a stack of its own, 64 requests alone and together
pytestmark = [pytest.mark.slow, pytest.mark.exactness]

WIDEST = 64
VOICES = ("ethan", "chelsie", "aiden")


@pytest.fixture(scope="module")
def omni(tiny_checkpoint):
    gemm = ("--exact-batching", "gemm")
    slots = ("--max-batch-size", str(WIDEST), "--num-slots", str(WIDEST), "--max-model-len", "256")
    with stack_of(tiny_checkpoint, thinker_args=gemm + slots, talker_args=gemm + slots,
                  code2wav_args=gemm + ("--max-batch", "16"),
                  router_args=("--max-in-flight", str(WIDEST), "--max-queue", str(WIDEST))) as stack:
        channel, stub = connect(stack.target)
        yield stub
        channel.close()


def case(i: int) -> dict:
    return dict(prompt=f"Request {i}: say" + " more" * (i % 7), voice=VOICES[i % 3],
                max_new_tokens=4 + i % 5, talker_max_new_tokens=6 + i % 7)


def run(omni, c: dict):
    request = build_request(c["prompt"], voice=c["voice"], max_new_tokens=c["max_new_tokens"],
                            talker_max_new_tokens=c["talker_max_new_tokens"], return_codec_frames=True)
    result = collect(omni, request, timeout=600)
    return result.thinker_token_ids, result.codec_frames, result.audio


def test_33_and_64_concurrent_requests_in_gemm_mode_equal_each_alone_and_generate(omni, tiny_checkpoint):
    cases = [case(i) for i in range(WIDEST)]
    alone = [run(omni, c) for c in cases]
    for width in (33, WIDEST):
        with ThreadPoolExecutor(max_workers=width) as pool:
            together = list(pool.map(lambda c: run(omni, c), cases[:width]))
        for i in range(width):
            assert together[i][:2] == alone[i][:2], f"{width} at once: request {i}'s ids or frames"
            assert np.array_equal(together[i][2], alone[i][2]), f"{width} at once: request {i}'s audio"
    reference = ReferenceRunner(tiny_checkpoint, gemm=True)
    for i in (0, 32, 63):
        c = cases[i]
        want = reference.generate([ChatMessage(Role.USER, (Part(text=c["prompt"]),))], voice=c["voice"],
                                  max_new_tokens=c["max_new_tokens"], talker_max_new_tokens=c["talker_max_new_tokens"])
        assert alone[i][0] == want.thinker_token_ids and alone[i][1] == want.codec_frames, f"request {i} vs generate"
