"""Iteration-level schedulers: plain synchronous Python, no I/O, no torch.

Each engine step is `plan = scheduler.schedule()`, then the engine runs the plan on the model,
then `scheduler.update(...)` with what the model produced. Requests join and leave the running
batch between steps; each running request owns one KV slot from its prefill to its end; a
request whose input is not there yet (the talker waiting for text) sits the step out.

`LMScheduler` serves both LMs: the thinker's requests are always ready; the talker's become
ready to prefill when their first text row arrives and ready to decode when the row their next
step needs (or the end of the text) is there. The engine tells the scheduler through
`set_ready`.

NOTE: admission. Every step prefills the waiting requests that fit beside the decode batch (free
slots, batch room, `max_prefills_per_step`: 0 = no cap) within a token budget
(`max_prefill_tokens`: 0 = none), in admission order; the engine runs them together (packed into
one forward where it can: services/runtime/lm/engine.py). With `chunking`, a prompt longer than the
budget left is prefilled a chunk a step (`StepPlan.chunks`), the requests running decoding between
its chunks, as vLLM V1 mixes chunked prefill into the decode batch; without it (exact mode's
per-row kernels, whose bits follow the row count), a prompt goes whole, in a step of its own when
it does not fit beside others: never refused for its length.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class Phase(enum.Enum):
    WAITING = "waiting"  # admitted, no slot yet
    RUNNING = "running"  # holds a slot


@dataclass
class SeqState:
    request_id: str
    prompt_len: int  # tokens the prefill puts in the cache
    max_new_tokens: int
    phase: Phase = Phase.WAITING
    slot: int | None = None
    generated: int = 0  # tokens produced so far (the prefill produces the first)
    ready: bool = True  # has the input its next step needs
    prefilled: int = 0  # prompt tokens in the cache: a chunked prefill in progress while below prompt_len

    @property
    def decoding(self) -> bool:
        return self.phase is Phase.RUNNING and self.prefilled >= self.prompt_len

    @property
    def needs_tokens(self) -> int:
        """Cache positions this request can use at most: prompt + every fed-back token."""
        return self.prompt_len + self.max_new_tokens


@dataclass(frozen=True)
class StepPlan:
    prefill: tuple[str, ...]  # request ids to prefill (a chunk of) this step (each holds a slot)
    decode: tuple[str, ...]  # running request ids that take one decode step together
    slots: dict = field(default_factory=dict)  # request_id -> slot, for every id above
    chunks: dict = field(default_factory=dict)  # request_id -> (start, stop): the prompt tokens prefilled now

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    def chunk(self, request_id: str) -> tuple[int, int] | None:
        """The part of the prompt this step prefills, None for all of it."""
        return self.chunks.get(request_id)


class CacheFull(Exception):
    """A request can never fit the cache (prompt + max tokens > slot length)."""


class LMScheduler:
    def __init__(self, max_batch_size: int, num_slots: int, slot_len: int, max_prefills_per_step: int = 1,
                 max_prefill_tokens: int = 0, chunking: bool = False):
        if max_batch_size < 1 or num_slots < 1:
            raise ValueError("max_batch_size and num_slots must be >= 1")
        if max_prefills_per_step < 0 or max_prefill_tokens < 0:
            raise ValueError("max_prefills_per_step and max_prefill_tokens must be >= 0 (0: no bound)")
        self.max_batch_size = max_batch_size
        self.slot_len = slot_len
        self.max_prefills_per_step = max_prefills_per_step  # 0: as many as fit
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens prefilled a step (0: no budget)
        self.chunking = chunking  # a prompt over the budget left is cut into chunks (see the NOTE)
        self.free_slots: deque[int] = deque(range(num_slots))
        self.waiting: deque[str] = deque()  # admission order
        self.partial: deque[str] = deque()  # holding a slot, prefilled a chunk at a time, in order
        self.seqs: dict[str, SeqState] = {}  # request_id -> state

    # Requests joining and leaving.
    def add(self, request_id: str, prompt_len: int, max_new_tokens: int, ready: bool = True) -> None:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id}")
        seq = SeqState(request_id, prompt_len, max_new_tokens, ready=ready)
        if seq.needs_tokens > self.slot_len:
            raise CacheFull(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the "
                            f"cache length per request ({self.slot_len})")
        self.seqs[request_id] = seq
        self.waiting.append(request_id)

    def abort(self, request_id: str) -> None:
        """Cancellation: drop the request wherever it is and free its slot."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.phase is Phase.WAITING:
            self.waiting.remove(request_id)
        elif seq.slot is not None:
            self.free_slots.append(seq.slot)
        if request_id in self.partial:
            self.partial.remove(request_id)

    def set_ready(self, request_id: str, ready: bool) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.ready = ready

    def reaches_length(self, request_id: str) -> bool:
        """Whether the token this step makes for `request_id` is its last by max_new_tokens. The
        one place the length stop is decided: the engines ask here, and `update` ends the request
        after the step by the same count."""
        seq = self.seqs.get(request_id)
        return seq is None or seq.generated + 1 >= seq.max_new_tokens

    # The step.
    def schedule(self) -> StepPlan:
        decode = [s.request_id for s in self.seqs.values() if s.decoding and s.ready]
        decode = decode[: self.max_batch_size]
        slots = {rid: self.seqs[rid].slot for rid in decode}
        prefill: list[str] = []
        chunks: dict[str, tuple[int, int]] = {}
        budget = self.max_prefill_tokens or float("inf")
        cap = min(self.max_prefills_per_step or self.max_batch_size, self.max_batch_size - len(decode))
        # Chunked prompts in progress first (they hold their slots), then new requests in admission
        # order while slots, batch room and the budget last. A request not ready yet does not block
        # the ones behind it; one over the budget does (it goes first in a later step).
        for rid in list(self.partial):
            seq = self.seqs[rid]
            if len(prefill) >= cap or budget <= 0:
                break
            if seq.ready:
                stop = seq.prefilled + int(min(seq.prompt_len - seq.prefilled, budget))
                chunks[rid], slots[rid] = (seq.prefilled, stop), seq.slot
                budget -= stop - seq.prefilled
                prefill.append(rid)
        for rid in list(self.waiting):
            if len(prefill) >= cap or not self.free_slots or budget <= 0:
                break
            seq = self.seqs[rid]
            if not seq.ready:
                continue
            length = seq.prompt_len
            if length > budget:
                if self.chunking:
                    length = int(budget)
                elif prefill:
                    break  # whole prompts only: it waits for a step it fits, or that it starts
            self.waiting.remove(rid)
            seq.phase, seq.slot = Phase.RUNNING, self.free_slots.popleft()
            slots[rid] = seq.slot
            chunks[rid] = (0, length)
            budget -= length
            prefill.append(rid)
        return StepPlan(prefill=tuple(prefill), decode=tuple(decode), slots=slots, chunks=chunks)

    def update(self, plan: StepPlan, finished: set[str]) -> list[str]:
        """Every planned request produced one token, but a chunk that leaves part of its prompt for
        later steps (it produced none); `finished` ones leave and free their slots."""
        for rid in plan.prefill + plan.decode:
            seq = self.seqs.get(rid)
            if seq is None:
                continue  # aborted while the step ran
            if rid in plan.chunks:
                seq.prefilled = plan.chunks[rid][1]
                if seq.prefilled < seq.prompt_len and rid not in finished:
                    if rid not in self.partial:
                        self.partial.append(rid)
                    continue
                if rid in self.partial:
                    self.partial.remove(rid)
            last = rid in finished or self.reaches_length(rid)
            seq.generated += 1
            if last:
                self.abort(rid)
        return [rid for rid in plan.prefill + plan.decode if rid in finished]

    # Load.
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return sum(1 for s in self.seqs.values() if s.phase is Phase.RUNNING)

    @property
    def slots_used(self) -> int:
        return self.running

    @property
    def has_work(self) -> bool:
        return any(s.ready and (s.phase is Phase.RUNNING or self.free_slots) for s in self.seqs.values())
