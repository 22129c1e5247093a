"""What the thinker and talker engines share: the loop-facing half of a slot-scheduled LM.

A subclass owns the model work (`prefill(request_id, slot)`, `decode(request_ids, slots)`, each
returning (request_id, EngineEvent) pairs; a `final` event ends its request) and keeps its
per-request state in `self._requests`. This class runs the step: schedule, prefill the new
requests, one batched decode of the running ones, what both left to do together (`end_step`:
the talker's code predictor over all their rows), then hand the results to the scheduler.
"""

from __future__ import annotations

import contextlib

from services.runtime.batching import using_kernels
from services.runtime.engine import EngineDefaults, StepResult
from services.runtime.invariance import ProbeReport
from services.runtime.scheduler import LMScheduler, StepPlan


class SlotScheduledEngine(EngineDefaults):
    scheduler: LMScheduler
    _requests: dict  # request_id -> the subclass's per-request state
    exact_report: ProbeReport | None = None  # exact mode's kernel paths here (services/runtime/invariance.py)

    def kernels(self):
        """The engine's exact-mode kernel paths on this thread, for a block of its model work."""
        return using_kernels(self.exact_report.kernels) if self.exact_report is not None else contextlib.nullcontext()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def running(self) -> int:
        return self.scheduler.running

    def step(self) -> StepResult:
        with self.kernels():
            return self._step()

    def _step(self) -> StepResult:
        plan = self.scheduler.schedule()
        events: StepResult = []
        for request_id in plan.prefill:
            events += self.prefill(request_id, plan.slots[request_id])
        if plan.decode:
            events += self.decode(list(plan.decode), [plan.slots[r] for r in plan.decode])
        events += self.end_step()
        finished = {request_id for request_id, event in events if event.final}
        self.scheduler.update(plan, finished)
        for request_id in finished:
            self._requests.pop(request_id, None)
        self.after_step(plan)
        return events

    def end_step(self) -> StepResult:
        """Hook: work this step's prefills and decode left to be done together (the talker's code
        predictor over all their rows); its events."""
        return []

    def after_step(self, plan: StepPlan) -> None:
        """Hook: e.g. mark requests whose next step must wait for input."""

    def prefill(self, request_id: str, slot: int) -> StepResult:
        raise NotImplementedError

    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        raise NotImplementedError
