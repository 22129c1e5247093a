"""Every aten op of the thinker's exact forwards, both families, is one the construction covers
(tests/op_audit.py; project issue 55): a decode batch past two vectors of AVX512 rows (`on`, after
the prefills, which run alone as `generate` runs them; `gemm`, prefills included), and with
`--exact-batching gemm` a prompt prefilled in chunks and prompts whose prefix hits cut at an odd and
an even number of cached blocks, each with the bits of its cold run.

Text prompts only: the audio and vision towers encode one media item per call, every row of it in
that call whatever the chunking or the batch, so their outputs are a function of the item alone
(docs/correctness.md).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.lm.prefix.keys import BLOCK_TOKENS
from services.runtime.lm.sampling import SamplingConfig
from services.thinker.admission import messages_from_proto, prompt_prefix
from services.thinker.engine import ThinkerEngineConfig, Token
from services.thinker.server import ADAPTERS
from tests.op_audit import OpAudit, by_construction

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

BATCH = 33  # past two vectors of AVX512 rows
MAX_NEW_TOKENS = 3


def request(system: str, user: str) -> omni_pb2.GenerateRequest:
    out = omni_pb2.GenerateRequest()
    out.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=system)
    out.messages.add(role=omni_pb2.ROLE_USER).content.add(text=user)
    return out


def job(family, proto: omni_pb2.GenerateRequest):
    prompt = family.builder.build(messages_from_proto(proto))
    made = family.adapter.job(prompt, SamplingConfig(max_new_tokens=MAX_NEW_TOKENS), True, (),
                              family.adapter.resolve_voice(None))
    return dataclasses.replace(made, prefix=prompt_prefix(proto, prompt.input_ids[0], family.im_start))


def engine(family, gemm: bool, slots: int = BATCH, **more):
    config = ThinkerEngineConfig(max_batch_size=slots, num_slots=slots, max_model_len=256, exact_gemm=gemm,
                                 max_prefills_per_step=0, **more)
    made = ADAPTERS[family_of(family.checkpoint)].engine(family.thinker.model, family.thinker.config,
                                                         engine_config=config)
    by_construction(made)
    return made


def run(engine, jobs: dict, audit: OpAudit | None = None, from_step: int = 0) -> dict:
    """Every job added at once, stepped to the end (`audit` around the steps from `from_step`):
    request id -> (ids, each token's logits)."""
    outs = {rid: ([], []) for rid in jobs}
    sample = engine._sample

    def recording(request_id, state, row_logits, *picked):
        outs[request_id][1].append(row_logits.detach().clone())
        return sample(request_id, state, row_logits, *picked)

    engine._sample = recording
    try:
        for rid, work in jobs.items():
            engine.add(rid, work)
        step = 0
        while engine.has_work():
            with audit if audit is not None and step >= from_step else contextlib.nullcontext():
                events = engine.step()
            step += 1
            for rid, event in events:
                if isinstance(event, Token):
                    outs[rid][0].append(event.token_id)
    finally:
        engine._sample = sample
    return outs


def assert_same_bits(got: tuple, want: tuple, where: str) -> None:
    assert got[0] == want[0] and len(got[0]) == MAX_NEW_TOKENS, f"{where}: ids"
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)), f"{where}: logits"


@pytest.mark.parametrize("gemm", [False, True], ids=["on", "gemm"])
def test_every_op_of_a_thinker_decode_batch_keeps_each_row_s_bits(family, gemm, monkeypatch):
    made = engine(family, gemm)
    jobs = {f"r{i}": job(family, request("Be brief.", "word " * (1 + i % 9) + f"number {i}")) for i in range(BATCH)}
    audit = OpAudit().watching(monkeypatch)
    together = run(made, jobs, audit, from_step=0 if gemm else 1)
    audit.assert_clean(f"thinker, {'gemm' if gemm else 'on'}")
    for rid in ("r0", "r31", "r32"):  # the rows in the last whole pair of vectors and past it
        assert_same_bits(together[rid], run(made, {rid: jobs[rid]})[rid], f"{rid} in a batch of {BATCH}")


@pytest.mark.slow  # make test's budget: the talkers' odd and even hits stay in it (tests/talker/test_prefix_cache.py)
def test_every_op_of_chunked_prefills_and_prefix_hits_at_odd_and_even_block_counts_keeps_the_cold_bits(
        family, monkeypatch):
    """gemm: a shared system prompt cached by a first request; then a request whose hit cuts after
    an odd or an even number of blocks, and the same request prefilled in chunks of 16 tokens
    (no cache); each equals its cold run bit for bit."""
    cached = engine(family, True, slots=2, prefix_cache_mb=8)
    chunked = engine(family, True, slots=2, max_prefill_tokens=BLOCK_TOKENS)
    cold = engine(family, True, slots=2)
    audit = OpAudit().watching(monkeypatch)
    blocks = set()
    for words in (4, 6):  # system prompts of several lengths: hits of several block counts
        system = " ".join(f"rule{i}" for i in range(words))
        run(cached, {"first": job(family, request(system, "Hello."))}, audit)
        before = cached.prefix_pool.stats.hit_tokens
        again = job(family, request(system, "And now something else entirely."))
        got = run(cached, {"again": again}, audit)["again"]
        hit = cached.prefix_pool.stats.hit_tokens - before
        assert hit % BLOCK_TOKENS == 0 and hit > 0, f"system of {words} words: {hit} tokens hit"
        blocks.add(hit // BLOCK_TOKENS)
        want = run(cold, {"again": again})["again"]
        assert_same_bits(got, want, f"a hit of {hit // BLOCK_TOKENS} blocks")
        assert_same_bits(run(chunked, {"again": again}, audit)["again"], want, "chunks of 16 tokens")
    assert {b % 2 for b in blocks} == {0, 1}, f"hits of {sorted(blocks)} blocks"
    audit.assert_clean("thinker, gemm, chunks and hits")
