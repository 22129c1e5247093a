"""A conversation through the stack with two thinker replicas and prefix caches: every turn goes to
the replica that holds the history, prefills only what is new there (the talker too: its prompt
repeats every earlier user turn), and still equals transformers' `generate` on the whole history
(ids and codec frames; audio against one vocoder forward).

The stack runs `--exact-batching gemm` (the mode whose cache hits are exact by construction:
services/thinker/prefix_probe.py), so the oracle is `generate` through the same invariant GEMM and
attention. Each turn re-sends the history, the model's own earlier replies included, as a client
of a voice assistant does; the first user turn carries an audio clip, the second an image.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.stage_metrics import scrape
from omni.v1 import omni_pb2
from services.thinker.admission import messages_from_proto
from services.tools.client import collect, connect
from services.tools.launcher import free_port_block
from services.tools.reference import ReferenceRunner
from tests.audio_checks import check_streamed_audio
from tests.stacks import stack_of

# slow: a stack of its own (two thinkers, the invariant GEMM) and generate per turn as the oracle
pytestmark = [pytest.mark.slow, pytest.mark.exactness]

TURNS = 8
MAX_TEXT, MAX_TALKER = 8, 14  # 13 frames: chunks of 4 and 9
USER_TEXTS = ("What do you hear?", "And in this picture?", "Why?", "Tell me more.", "Anything else?",
              "Say it shorter.", "Now in French.", "Thanks!")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    gemm = ("--exact-batching", "gemm")
    base = free_port_block()
    with stack_of(tiny_checkpoint, thinker_replicas=2, thinker_args=gemm + ("--prefix-cache-mb", "16"),
                  talker_args=gemm + ("--prefix-cache-mb", "16"), router_args=("--routing", "prefix", "--poll-interval-s", "0.2"),
                  metrics_base_port=base) as running:
        yield running


def prefix_counters(stack, stage: str) -> dict[str, dict[str, float]]:
    """`stage`'s process name -> omni_prefix_cache_* counter -> value, read from its metrics port."""
    out = {}
    for name, process in stack.processes.items():
        if name.startswith(stage):
            port = process.args[process.args.index("--metrics-port") + 1]
            out[name] = {sample: value for (sample, _), value in scrape(f"http://127.0.0.1:{port}/metrics").items()
                         if sample.startswith("omni_prefix_cache_")}
    return out


def test_every_turn_goes_where_its_history_is_and_equals_generate_on_the_whole_history(stack, tiny_checkpoint,
                                                                                      wav_bytes, png_bytes):
    channel, omni = connect(stack.target)
    reference = ReferenceRunner(tiny_checkpoint, gemm=True)
    request = omni_pb2.GenerateRequest(return_codec_frames=True)
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text="You are a helpful voice assistant.")
    request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
    request.thinker_sampling.max_new_tokens = MAX_TEXT
    request.talker_sampling.max_new_tokens = MAX_TALKER
    try:
        for turn, text in enumerate(USER_TEXTS[:TURNS]):
            user = request.messages.add(role=omni_pb2.ROLE_USER)
            if turn == 0:
                user.content.add(audio=wav_bytes)
            if turn == 1:
                user.content.add(image=png_bytes)
            user.content.add(text=text)
            got = collect(omni, request, timeout=120)
            want = reference.generate(messages_from_proto(request), max_new_tokens=MAX_TEXT,
                                      talker_max_new_tokens=MAX_TALKER)
            assert got.thinker_token_ids == want.thinker_token_ids, f"turn {turn + 1}"
            assert got.codec_frames == want.codec_frames, f"turn {turn + 1}"
            check_streamed_audio(reference.model.code2wav, want.codec_frames, got.audio)
            assert np.sqrt(np.mean(got.audio ** 2)) > 0.01
            request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=got.text)
    finally:
        channel.close()
    counters = prefix_counters(stack, "thinker")
    hits = {name: c["omni_prefix_cache_hit_tokens_total"] for name, c in counters.items()}
    lookups = {name: c["omni_prefix_cache_lookup_tokens_total"] for name, c in counters.items()}
    # One replica served the conversation from its second turn on (the first went to either):
    # every hit is there, and it found most of what it looked up.
    holder = max(hits, key=hits.get)
    assert hits[holder] > 0 and all(v == 0 for name, v in hits.items() if name != holder), hits
    assert hits[holder] >= 0.5 * lookups[holder], (hits, lookups)
    assert all(c["omni_prefix_cache_refused_tokens_total"] == 0 for c in counters.values())
    (talker,) = prefix_counters(stack, "talker").values()  # its prompt: every user turn, then 9 assistant rows
    assert talker["omni_prefix_cache_hit_tokens_total"] > 0 and talker["omni_prefix_cache_refused_tokens_total"] == 0
