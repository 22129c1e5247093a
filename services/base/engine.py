"""The contract between a stage's engine and the loop that drives it (services/serving/engine_loop.py).

An engine is single-threaded: the loop thread makes every call. `add` takes a request's job,
`add_input` more input for it (a text row, codec frames, an end mark), `abort` drops it; `step`
runs one step of model work over whatever is ready and returns a `StepResult`: (request_id,
event) pairs in the order they happened, a `final` event being a request's last.

The optional parts have defaults in `EngineDefaults`, so the loop calls them without asking
whether they exist: `timer` (seconds spent in model forwards, for the forward/engine split of
the step metrics), `wake_in` (a step due by a time of the engine's own while idle: the thinker's
text holds), `exact_report` (exact mode's kernel paths, exported), `adopt_checks` (the faster
paths of a start-up check that ran beside serving, once it passed: services/runtime/checks.py)
and `close` (resources outside the process: the vLLM backend's engine core).
"""

from __future__ import annotations

from typing import Any, Protocol

from services.base.events import EngineEvent
from services.base.timing import ForwardTimer

StepResult = list[tuple[str, EngineEvent]]  # (request_id, event) pairs of one step, in order


class KernelReport(Protocol):
    """What the loop exports of exact mode's plan (services.runtime.lm.invariance.KernelVerdict,
    services.code2wav.plan.BlockPlan). Declared here, not imported: the serving plumbing that
    reads it holds no torch code."""

    check: str  # where it came from: a CheckState (services/runtime/checks.py)

    def paths(self) -> dict[str, str]: ...  # op -> the path the probe chose for it

    def settings(self) -> dict[str, float]: ...  # name -> a number the probe chose (code2wav's block size)


class Engine(Protocol):
    """What a stage engine offers the loop. All calls happen on the loop thread."""

    timer: ForwardTimer | None
    exact_report: KernelReport | None
    step_prefills: int

    def add(self, request_id: str, payload: Any) -> None: ...  # payload: the stage's job type
    def add_input(self, request_id: str, payload: Any) -> None: ...  # payload: the stage's input type
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepResult: ...
    def wake_in(self) -> float | None: ...  # seconds until a step is due while idle; None: not before input
    def adopt_checks(self) -> None: ...  # a start-up check's faster plan, once it ended (loop thread, between steps)
    def close(self) -> None: ...

    @property
    def queue_depth(self) -> int: ...  # requests admitted, waiting for a slot or for input

    @property
    def running(self) -> int: ...  # requests holding a KV slot / decoder


class EngineDefaults:
    """The optional half of `Engine`, for engines that have nothing to say there."""

    timer: ForwardTimer | None = None
    exact_report: KernelReport | None = None
    step_prefills: int = 0  # prompts (or prompt chunks) the last step prefilled (omni_stage_prefills_per_step)

    def wake_in(self) -> float | None:
        return None

    def adopt_checks(self) -> None:
        pass

    def close(self) -> None:
        pass
