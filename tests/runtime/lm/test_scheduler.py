"""LMScheduler on made-up model outputs: plain Python, no torch, milliseconds.

Each test drives `schedule() -> plan`, pretends the model ran the plan, then `update(plan,
finished)`, and checks who joined, who left, who waited and which slots are held.
"""

from __future__ import annotations

import random

import pytest

from services.runtime.lm.scheduler import CacheFull, LMScheduler, Phase


def step(s: LMScheduler, finished: set[str] = frozenset()):
    """One engine step where the model produces one token for every planned request."""
    plan = s.schedule()
    s.update(plan, set(finished))
    return plan


def held_slots(s: LMScheduler) -> list[int]:
    return [seq.slot for seq in s.seqs.values() if seq.phase is Phase.RUNNING]


def assert_slots_consistent(s: LMScheduler, num_slots: int) -> None:
    held = held_slots(s)
    free = list(s.free_slots)
    assert len(held) == len(set(held)), f"a slot is held twice: {held}"
    assert len(free) == len(set(free)), f"a slot is free twice (double free): {free}"
    assert not set(held) & set(free), f"a slot is both held and free: {held} {free}"
    assert sorted(held + free) == list(range(num_slots))
    assert s.running == len(held) == s.slots_used
    assert all(seq.slot is None for seq in s.seqs.values() if seq.phase is Phase.WAITING)


# Construction and admission.

def test_rejects_empty_batch_or_cache():
    with pytest.raises(ValueError):
        LMScheduler(max_batch_size=0, num_slots=1, slot_len=8)
    with pytest.raises(ValueError):
        LMScheduler(max_batch_size=1, num_slots=0, slot_len=8)


def test_duplicate_request_id_is_rejected():
    s = LMScheduler(2, 2, 64)
    s.add("a", 4, 4)
    with pytest.raises(ValueError, match="duplicate"):
        s.add("a", 4, 4)


def test_request_that_can_never_fit_raises_cache_full_and_is_not_queued():
    s = LMScheduler(2, 2, slot_len=16)
    with pytest.raises(CacheFull):
        s.add("big", prompt_len=10, max_new_tokens=7)  # 17 > 16
    assert s.queue_depth == 0 and not s.has_work and "big" not in s.seqs
    s.add("big", prompt_len=10, max_new_tokens=6)  # exactly 16 fits; the id is free again
    assert s.queue_depth == 1


def test_admission_is_fifo():
    s = LMScheduler(max_batch_size=4, num_slots=1, slot_len=64)
    for rid in "abcd":
        s.add(rid, 4, 2)
    order = []
    while s.has_work:
        plan = step(s)
        order += plan.prefill
    assert order == list("abcd")


def test_at_most_max_prefills_per_step_in_admission_order():
    s = LMScheduler(max_batch_size=8, num_slots=8, slot_len=64, max_prefills_per_step=2)
    for rid in "abcde":
        s.add(rid, 4, 10)
    assert step(s).prefill == ("a", "b")
    plan = step(s)
    assert plan.prefill == ("c", "d") and plan.decode == ("a", "b")
    assert step(s).prefill == ("e",)


# Joining and leaving.

def test_request_added_while_others_run_is_prefilled_beside_their_decode():
    s = LMScheduler(max_batch_size=4, num_slots=4, slot_len=64)
    s.add("a", 5, 10)
    assert step(s).prefill == ("a",)
    s.add("b", 7, 10)
    plan = step(s)
    assert plan.prefill == ("b",) and plan.decode == ("a",)
    assert plan.slots["a"] != plan.slots["b"]
    plan = step(s)
    assert plan.prefill == () and plan.decode == ("a", "b")
    assert s.running == 2 and s.queue_depth == 0


def test_step_never_exceeds_max_batch_size():
    s = LMScheduler(max_batch_size=2, num_slots=6, slot_len=64, max_prefills_per_step=3)
    for i in range(6):
        s.add(f"r{i}", 4, 5)
    while s.has_work:
        plan = s.schedule()
        assert len(plan.decode) + len(plan.prefill) <= 2
        s.update(plan, set())
        assert s.running <= 2  # always-ready requests: a prefill only when the batch has room
    assert len(s.free_slots) == 6


def test_max_new_tokens_frees_the_slot_counting_the_prefill_token():
    s = LMScheduler(2, 1, 64)
    s.add("a", 4, max_new_tokens=3)
    assert step(s).prefill == ("a",)  # token 1
    assert step(s).decode == ("a",)  # token 2
    assert s.running == 1
    assert step(s).decode == ("a",)  # token 3: the limit
    assert s.running == 0 and list(s.free_slots) == [0] and "a" not in s.seqs
    assert not s.has_work


def test_finished_request_leaves_and_its_slot_is_reused():
    s = LMScheduler(max_batch_size=2, num_slots=1, slot_len=64)
    s.add("a", 4, 50)
    s.add("b", 4, 50)
    plan = step(s)
    assert plan.prefill == ("a",) and s.queue_depth == 1
    plan = s.schedule()
    assert plan.decode == ("a",) and plan.prefill == ()  # no free slot for b
    assert s.update(plan, {"a"}) == ["a"]
    assert s.running == 0 and s.queue_depth == 1
    plan = step(s)
    assert plan.prefill == ("b",) and plan.slots["b"] == 0


def test_update_returns_only_the_finished_ids_it_was_given():
    # Requests that hit max_new_tokens leave too, but the engine already knows: its own Token
    # event says `last`, so update reports only what the model finished.
    s = LMScheduler(4, 4, 64)
    s.add("a", 4, 1)
    s.add("b", 4, 5)
    s.max_prefills_per_step = 2
    plan = s.schedule()
    assert s.update(plan, {"b"}) == ["b"]
    assert not s.seqs


# Full cache.

def test_full_cache_queues_new_requests_until_a_slot_frees():
    s = LMScheduler(max_batch_size=8, num_slots=2, slot_len=64, max_prefills_per_step=8)
    for rid in "abcd":
        s.add(rid, 4, 50)
    plan = step(s)
    assert plan.prefill == ("a", "b")
    assert s.queue_depth == 2 and s.running == 2 and not s.free_slots
    for _ in range(3):  # still full: c and d keep waiting while a and b decode
        plan = step(s)
        assert plan.prefill == () and plan.decode == ("a", "b") and s.queue_depth == 2
    plan = s.schedule()
    s.update(plan, {"b"})
    freed = plan.slots["b"]
    plan = step(s)
    assert plan.prefill == ("c",) and plan.slots["c"] == freed and s.queue_depth == 1
    assert_slots_consistent(s, 2)


# Waiting for input (the talker).

def test_not_ready_request_is_not_prefilled_until_set_ready():
    s = LMScheduler(2, 2, 64)
    s.add("a", 4, 10, ready=False)
    assert s.schedule().empty and not s.has_work and s.queue_depth == 1 and s.running == 0
    s.set_ready("a", True)
    assert s.has_work
    assert step(s).prefill == ("a",)


def test_not_ready_waiting_request_does_not_block_ready_ones_behind_it():
    s = LMScheduler(max_batch_size=4, num_slots=4, slot_len=64, max_prefills_per_step=4)
    s.add("slow", 4, 10, ready=False)
    s.add("b", 4, 10)
    s.add("c", 4, 10)
    plan = step(s)
    assert plan.prefill == ("b", "c")
    assert s.queue_depth == 1 and s.seqs["slow"].phase is Phase.WAITING
    s.set_ready("slow", True)
    plan = step(s)
    assert plan.prefill == ("slow",) and plan.decode == ("b", "c")


def test_running_request_that_is_not_ready_sits_out_without_holding_others_back():
    s = LMScheduler(max_batch_size=4, num_slots=4, slot_len=64, max_prefills_per_step=4)
    s.add("a", 4, 10)
    s.add("b", 4, 10)
    step(s)
    slot_a = s.seqs["a"].slot
    s.set_ready("a", False)
    for _ in range(3):
        plan = step(s)
        assert plan.decode == ("b",)
        assert s.seqs["a"].slot == slot_a and s.running == 2  # keeps its slot while it waits
    assert s.seqs["a"].generated == 1 and s.seqs["b"].generated == 4
    s.set_ready("a", True)
    assert step(s).decode == ("a", "b")


def test_set_ready_on_unknown_request_is_ignored():
    s = LMScheduler(1, 1, 8)
    s.set_ready("nobody", True)
    assert not s.has_work


# Cancellation.

def test_abort_waiting_request_removes_it_from_the_queue():
    s = LMScheduler(1, 1, 64)
    s.add("a", 4, 10)
    s.add("b", 4, 10)
    step(s)
    s.abort("b")
    assert s.queue_depth == 0 and "b" not in s.seqs
    assert_slots_consistent(s, 1)


def test_abort_mid_batch_frees_the_slot_once_and_update_does_not_resurrect_it():
    s = LMScheduler(max_batch_size=4, num_slots=3, slot_len=64, max_prefills_per_step=4)
    for rid in "abc":
        s.add(rid, 4, 10)
    step(s)
    plan = s.schedule()  # a, b, c decode together
    assert plan.decode == ("a", "b", "c")
    s.abort("b")  # the client cancels while the step runs
    assert len(s.free_slots) == 1
    s.abort("b")  # a second cancel (handler and loop both) is a no-op
    assert len(s.free_slots) == 1
    s.update(plan, {"b"})  # the model's output for b arrives anyway, even as "finished"
    assert "b" not in s.seqs and s.running == 2 and len(s.free_slots) == 1
    assert_slots_consistent(s, 3)
    assert step(s).decode == ("a", "c")


def test_abort_of_a_request_prefilled_in_this_step_frees_its_new_slot():
    s = LMScheduler(2, 2, 64)
    s.add("a", 4, 10)
    plan = s.schedule()
    assert plan.prefill == ("a",)
    s.abort("a")
    s.update(plan, set())
    assert not s.seqs and sorted(s.free_slots) == [0, 1] and not s.has_work


def test_abort_of_a_request_that_hits_its_limit_in_the_same_step_frees_once():
    s = LMScheduler(2, 2, 64)
    s.add("a", 4, 1)
    plan = s.schedule()
    s.abort("a")
    s.update(plan, {"a"})  # would have left by max_new_tokens and by finished
    assert sorted(s.free_slots) == [0, 1]


def test_abort_unknown_request_is_a_no_op():
    s = LMScheduler(1, 1, 8)
    s.abort("nobody")
    assert list(s.free_slots) == [0]


# has_work: "a step now would do something".

def test_has_work_semantics():
    s = LMScheduler(max_batch_size=1, num_slots=1, slot_len=64)
    assert not s.has_work  # nothing at all
    s.add("a", 4, 10, ready=False)
    assert not s.has_work  # waiting, but its input is not there
    s.set_ready("a", True)
    assert s.has_work  # waiting, ready, a slot is free
    step(s)
    assert s.has_work  # running and ready
    s.add("b", 4, 10)
    s.set_ready("a", False)
    assert not s.has_work  # a holds the only slot and waits; b cannot get a slot
    assert s.schedule().empty
    s.set_ready("a", True)
    assert s.has_work
    s.abort("a")
    assert s.has_work  # b can take the freed slot
    step(s)
    s.abort("b")
    assert not s.has_work and list(s.free_slots) == [0]


# Property-style: a small engine loop over many random steps.

class RandomLoop:
    """A small engine loop over a scheduler: requests join, wait for input, finish, hit their
    length or are cancelled at random, and every step's plan is checked against the rules."""

    num_slots, max_batch, slot_len, n_requests = 4, 3, 40, 60

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.s = LMScheduler(self.max_batch, self.num_slots, self.slot_len, max_prefills_per_step=2)
        self.admitted: list[str] = []  # admission order
        self.tokens: dict[str, int] = {}  # request_id -> tokens produced, counted here
        self.limits: dict[str, int] = {}  # request_id -> max_new_tokens
        self.ended: dict[str, str] = {}  # request_id -> how it ended

    @property
    def adding(self) -> bool:
        return len(self.admitted) < self.n_requests

    def arrive(self) -> None:
        """Maybe a new request; inputs arrive (or run dry) at random; now and then a cancel.
        Everyone is ready once adding stops."""
        rng, s, adding = self.rng, self.s, self.adding
        if adding and rng.random() < 0.4:
            rid = f"r{len(self.admitted)}"
            prompt, new = rng.randint(1, 30), rng.randint(1, 15)
            if prompt + new > self.slot_len:
                with pytest.raises(CacheFull):
                    s.add(rid, prompt, new)
                self.ended[rid] = "cache_full"
            else:
                s.add(rid, prompt, new, ready=rng.random() < 0.7)
                self.tokens[rid], self.limits[rid] = 0, new
            self.admitted.append(rid)
        live = list(s.seqs)
        for rid in live:
            if not adding or rng.random() < 0.3:
                s.set_ready(rid, not adding or rng.random() < 0.8)
        if live and rng.random() < 0.03:
            rid = rng.choice(live)
            s.abort(rid)
            self.ended[rid] = "aborted"

    def plan(self):
        s = self.s
        has_work, waiting_before = s.has_work, list(s.waiting)
        plan = s.schedule()
        assert has_work == (not plan.empty), "has_work must say whether a step would do anything"
        assert len(plan.decode) + len(plan.prefill) <= self.max_batch
        assert len(plan.prefill) <= s.max_prefills_per_step
        assert not set(plan.decode) & set(plan.prefill)
        assert len(set(plan.slots.values())) == len(plan.slots) == len(plan.decode) + len(plan.prefill)
        for rid in plan.decode:
            assert s.seqs[rid].ready and s.seqs[rid].phase is Phase.RUNNING
        # FIFO: no ready request still waiting was admitted before one prefilled now.
        prefilled = set(plan.prefill)
        for rid in waiting_before:
            if rid in prefilled:
                prefilled.discard(rid)
            elif s.seqs[rid].ready and rid in s.waiting:
                assert not prefilled, f"{rid} was skipped for a later request"
        assert_slots_consistent(s, self.num_slots)
        return plan

    def run(self, plan) -> None:
        """The model's step: a cancel may land while it runs; each row makes a token, some an end
        token; the scheduler's length stop must agree with the count kept here."""
        rng, s = self.rng, self.s
        if plan.decode and rng.random() < 0.1:
            rid = rng.choice(plan.decode)
            s.abort(rid)
            self.ended[rid] = "aborted"
        finished = set()
        for rid in plan.prefill + plan.decode:
            if rid in self.tokens and rid not in self.ended:
                self.tokens[rid] += 1
                assert s.reaches_length(rid) == (self.tokens[rid] == self.limits[rid]), rid
                if rng.random() < 0.05:
                    finished.add(rid)  # end token
        s.update(plan, finished)
        for rid in plan.prefill + plan.decode:
            if rid not in s.seqs and rid not in self.ended:
                self.ended[rid] = "finished" if rid in finished else "length"
        for rid, n in self.tokens.items():
            assert n <= self.limits[rid]
            if self.ended.get(rid) == "length":
                assert n == self.limits[rid]
        assert_slots_consistent(s, self.num_slots)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_engine_loop_keeps_slot_invariants_and_every_request_ends(seed):
    loop = RandomLoop(seed)
    for _ in range(2000):
        loop.arrive()
        loop.run(loop.plan())
        if not loop.adding and not loop.s.seqs:
            break
    s = loop.s
    assert len(loop.admitted) == loop.n_requests and not s.seqs, "every request ends"
    assert set(loop.ended) == set(loop.admitted)
    assert sorted(s.free_slots) == list(range(loop.num_slots)) and s.queue_depth == 0 and not s.has_work
    assert {"finished", "length", "aborted"} <= set(loop.ended.values())  # the run exercised every exit


def test_decode_stays_capped_when_waiting_requests_let_running_exceed_max_batch_size():
    # With num_slots > max_batch_size, a request that sits out leaves room for a prefill, so
    # more requests can hold slots than fit one decode. The decode is still capped, oldest first:
    # the newer request sits out until an older one leaves or waits again.
    s = LMScheduler(max_batch_size=1, num_slots=2, slot_len=64)
    s.add("a", 4, 5)
    step(s)
    s.set_ready("a", False)
    s.add("b", 4, 5)
    assert step(s).prefill == ("b",)
    s.set_ready("a", True)
    assert s.running == 2
    plan = step(s)
    assert plan.decode == ("a",) and plan.prefill == ()
    while "a" in s.seqs:
        assert step(s).decode == ("a",)
    assert step(s).decode == ("b",)


# Admission in one step: a token budget, chunks of longer prompts.

def test_every_waiting_request_that_fits_the_budget_is_admitted_in_one_step():
    s = LMScheduler(max_batch_size=8, num_slots=8, slot_len=256, max_prefills_per_step=0, max_prefill_tokens=40)
    for i, n in enumerate((10, 12, 15, 20)):
        s.add(f"r{i}", n, 4)
    plan = s.schedule()
    assert plan.prefill == ("r0", "r1", "r2") and plan.chunks == {"r0": (0, 10), "r1": (0, 12), "r2": (0, 15)}
    s.update(plan, set())
    assert s.schedule().prefill == ("r3",)  # over what was left: first in the next step, beside the decodes


def test_a_prompt_over_the_budget_is_chunked_and_the_running_ones_decode_between_its_chunks():
    s = LMScheduler(max_batch_size=8, num_slots=8, slot_len=256, max_prefills_per_step=0, max_prefill_tokens=16,
                    chunking=True)
    s.add("short", 6, 10)
    s.update(s.schedule(), set())
    s.add("long", 40, 4)
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        assert plan.decode == ("short",)  # a decode step every step
        chunks.append(plan.chunks["long"])
        s.update(plan, set())
    assert chunks == [(0, 16), (16, 32), (32, 40)]  # 16 prompt tokens a step, the decodes beside them
    assert "long" in s.schedule().decode and not s.partial


def test_a_request_aborted_or_finished_mid_chunk_frees_its_slot():
    s = LMScheduler(max_batch_size=4, num_slots=2, slot_len=256, max_prefills_per_step=0, max_prefill_tokens=8,
                    chunking=True)
    s.add("a", 30, 4)
    s.update(s.schedule(), set())
    assert list(s.partial) == ["a"] and len(s.free_slots) == 1
    s.abort("a")
    assert not s.partial and len(s.free_slots) == 2
    s.add("b", 30, 4)
    s.update(s.schedule(), {"b"})  # the engine ended it during a chunk (a talker whose text ended early)
    assert "b" not in s.seqs and not s.partial and len(s.free_slots) == 2


def test_without_chunking_a_prompt_over_the_budget_goes_whole_in_a_step_it_starts():
    s = LMScheduler(max_batch_size=8, num_slots=8, slot_len=256, max_prefills_per_step=0, max_prefill_tokens=16)
    s.add("small", 10, 4)
    s.add("big", 100, 4)
    assert s.schedule().chunks == {"small": (0, 10)}
    assert s.schedule().chunks == {"big": (0, 100)}  # never refused for its length
