"""Iteration-level schedulers: plain synchronous Python, no I/O, no torch.

Each engine step is `plan = scheduler.schedule()`, then the engine runs the plan on the model,
then `scheduler.update(...)` with what the model produced. Requests join and leave the running
batch between steps; each running request owns one KV slot from its prefill to its end; a
request whose input is not there yet (the talker waiting for text) sits the step out.

`LMScheduler` serves both LMs: the thinker's requests are always ready; the talker's become
ready to prefill when their first text row arrives and ready to decode when the row their next
step needs (or the end of the text) is there. The engine tells the scheduler through
`set_ready`.
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

    @property
    def needs_tokens(self) -> int:
        """Cache positions this request can use at most: prompt + every fed-back token."""
        return self.prompt_len + self.max_new_tokens


@dataclass(frozen=True)
class StepPlan:
    prefill: tuple[str, ...]  # request ids to prefill this step (each gets a slot)
    decode: tuple[str, ...]  # running request ids that take one decode step together
    slots: dict = field(default_factory=dict)  # request_id -> slot, for every id above

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class CacheFull(Exception):
    """A request can never fit the cache (prompt + max tokens > slot length)."""


class LMScheduler:
    def __init__(self, max_batch_size: int, num_slots: int, slot_len: int, max_prefills_per_step: int = 1):
        if max_batch_size < 1 or num_slots < 1:
            raise ValueError("max_batch_size and num_slots must be >= 1")
        self.max_batch_size = max_batch_size
        self.slot_len = slot_len
        self.max_prefills_per_step = max_prefills_per_step
        self.free_slots: deque[int] = deque(range(num_slots))
        self.waiting: deque[str] = deque()  # admission order
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
        decode = [s.request_id for s in self.seqs.values() if s.phase is Phase.RUNNING and s.ready]
        decode = decode[: self.max_batch_size]
        prefill: list[str] = []
        slots = {rid: self.seqs[rid].slot for rid in decode}
        # Prefill new requests beside the decode batch, in admission order, while slots and batch
        # room last. A waiting request that is not ready yet does not block the ones behind it.
        room = self.max_batch_size - len(decode)
        for rid in list(self.waiting):
            if len(prefill) >= min(self.max_prefills_per_step, room) or not self.free_slots:
                break
            seq = self.seqs[rid]
            if not seq.ready:
                continue
            self.waiting.remove(rid)
            seq.phase, seq.slot = Phase.RUNNING, self.free_slots.popleft()
            slots[rid] = seq.slot
            prefill.append(rid)
        return StepPlan(prefill=tuple(prefill), decode=tuple(decode), slots=slots)

    def update(self, plan: StepPlan, finished: set[str]) -> list[str]:
        """Every planned request produced one token; `finished` ones leave and free their slots."""
        for rid in plan.prefill + plan.decode:
            seq = self.seqs.get(rid)
            if seq is None:
                continue  # aborted while the step ran
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
