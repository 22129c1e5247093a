"""A thinker serves before exact mode's check ended and adopts its verdict between steps, both
families (services/runtime/lm/engine.py `start_exact_check`, `adopt_checks`): requests running
across the switch (per-row kernels to the checked batched ones; prefix hits refused, then used)
get the bits they get from an engine that checked before serving."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from services.base.families import family_of
from services.runtime.checks import CheckState
from services.runtime.lm import invariance
from services.runtime.lm.prefix import check as prefix_check
from services.runtime.model.settings import CheckSettings
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig, Token
from services.thinker.server import ADAPTERS
from tests.thinker.test_prefix_conversation import (  # noqa: F401 - fixtures
    MAX_MODEL_LEN,
    assert_same_bits,
    conversation,
    job,
    make_engine,
    run,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]


def gate(monkeypatch) -> threading.Event:
    """From now on a check waits for this before it runs its probes (the kernels' and the prefix hits')."""
    event = threading.Event()
    for module, name in ((invariance, "check_exact_kernels"), (prefix_check, "hits_differ")):
        original = getattr(module, name)

        def gated(*args, _original=original, **kwargs):
            assert event.wait(60)
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, gated)
    return event


def beside(family_, mode: str, cache_mb: int) -> ThinkerEngine:
    """make_engine's engine, its check beside serving."""
    config = ThinkerEngineConfig(max_batch_size=8, num_slots=8, max_model_len=MAX_MODEL_LEN, exact_batching=True,
                                 exact_gemm=mode == "gemm", prefix_cache_mb=cache_mb,
                                 checks=CheckSettings(background=True))
    engine_cls = ADAPTERS[family_of(family_.checkpoint)].engine
    return engine_cls(family_.thinker.model, family_.thinker.config, engine_config=config)


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["rows", "gemm"])
def test_requests_across_the_switch_to_the_checked_plan_get_the_bits_of_a_checked_engine(
        family, mode, monkeypatch, wav_bytes, png_bytes):
    checked = make_engine(family, mode, cache_mb=16)
    opened = gate(monkeypatch)
    engine = beside(family, mode, cache_mb=16)
    assert engine.exact_report.check is CheckState.RUNNING and not engine.prefix_hits
    assert engine.exact_report.paths()["prefix_hit"] == "refused"
    jobs = {f"t{turn}": job(family, conversation(turn, wav_bytes, png_bytes)) for turn in (1, 2)}
    for rid, j in jobs.items():
        engine.add(rid, j)
    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    for _ in range(3):  # both prefilled and decoding, on the by-construction plan
        for rid, event in engine.step():
            if isinstance(event, Token):
                tokens[rid].append(event.token_id)
    opened.set()
    assert engine.exact_check.wait(120)
    while engine.has_work():  # the next step adopts the verdict first
        for rid, event in engine.step():
            if isinstance(event, Token):
                tokens[rid].append(event.token_id)
    assert engine.exact_report.check is CheckState.CHECKED
    assert engine.exact_report == dataclasses.replace(checked.exact_report, seconds=engine.exact_report.seconds)
    assert engine.prefix_hits is checked.prefix_hits is (mode == "gemm")
    want = run(checked, jobs)
    assert tokens == {rid: out.tokens for rid, out in want.items()}
    # The next turn (turn 2's history): from cached blocks in gemm mode, with the cold bits.
    third = {"t3": job(family, conversation(3, wav_bytes, png_bytes))}
    assert_same_bits(run(engine, third)["t3"], run(checked, third)["t3"], "turn 3")
    assert (engine.prefix_pool.stats.hit_tokens > 0) is (mode == "gemm")
