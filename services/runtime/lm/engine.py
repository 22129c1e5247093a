"""What the thinker and talker engines share: the loop-facing half of a slot-scheduled LM.

A subclass owns the model work (`prefill(request_id, slot)`, `decode(request_ids, slots)`, each
returning (request_id, EngineEvent) pairs; a `final` event ends its request) and keeps its
per-request state in `self._requests`. This class runs the step: schedule, prefill the new
requests, one batched decode of the running ones, what both left to do together (`end_step`:
the talker's code predictor over all their rows), then hand the results to the scheduler.
"""

from __future__ import annotations

import contextlib
import dataclasses

from services.base.engine import EngineDefaults, StepResult
from services.runtime.checks import CheckState, StartupCheck
from services.runtime.lm.invariance import ProbeReport, by_construction, exact_check, log_report
from services.runtime.lm.kernels import using_kernels
from services.runtime.lm.scheduler import LMScheduler, StepPlan


class SlotScheduledEngine(EngineDefaults):
    scheduler: LMScheduler
    _requests: dict  # request_id -> the subclass's per-request state
    exact_report: ProbeReport | None = None  # exact mode's kernel paths here (services/runtime/lm/invariance.py)
    exact_check: StartupCheck | None = None  # the check whose verdict replaces them, beside serving

    def start_exact_check(self, stage: str, settings, **probe) -> None:
        """Exact mode's plan: a verdict kept on disk or checked now (before serving), else the paths
        invariant by construction while the check runs beside serving (`adopt_checks` takes its
        verdict). `probe`: invariance.exact_check's."""
        safe = by_construction(probe["gemm"])
        self.exact_check = exact_check(stage, settings, **probe)
        verdict = self.exact_check.start()
        self.exact_report = dataclasses.replace(verdict or safe, check=self.exact_check.state)
        if verdict is not None:
            self.adopt_verdict(self.exact_report)
        if self.exact_check.state is not CheckState.RUNNING:
            log_report(self.exact_report, self.exact_check)

    def adopt_checks(self) -> None:
        """The check's verdict, once it ended beside serving, between steps: every path it adopts
        gives each row the bits the per-row path gives it."""
        check = self.exact_check
        if check is None or not check.ended():
            return
        verdict = check.verdict or self.exact_report
        # The engine's own entries (a talker's prefix-hit policy, by mode) stay unless the check decided them.
        report = dataclasses.replace(verdict, check=check.state, more={**self.exact_report.more, **verdict.more})
        if check.verdict is not None:
            self.adopt_verdict(report)
        self.exact_report = report
        log_report(report, check)

    def adopt_verdict(self, report: ProbeReport) -> None:
        """Hook: what the engine takes from a verdict besides the kernel paths (the thinker's prefix hits)."""

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
        self.adopt_checks()
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
