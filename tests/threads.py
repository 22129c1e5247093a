"""How many torch threads the tests' models run on, in this process and in every stage process a
test starts: OMNI_TEST_THREADS=N sets both (make test-portable runs the exactness tests at 1 and 2).

Unset, each place keeps its default: in-process, tests/conftest.py gives each xdist worker its
share of the cores and the tiny-model modules pin one thread (`torch_threads(1)`); stage
processes get `--threads 1` (tests/stacks.py). Tests whose subject is a thread count (the column
tiles, used on one thread only; test_batching's `threads`) set their own whatever this says.
"""

from __future__ import annotations

import os

THREADS_ENV = "OMNI_TEST_THREADS"


def configured_threads() -> int | None:
    """OMNI_TEST_THREADS as a positive int, None when unset or empty; ValueError otherwise."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: expected a whole number of threads >= 1")
    return int(value)


def torch_threads(default: int) -> int:
    """The thread count a test's models (or a stage process it starts) run on: OMNI_TEST_THREADS
    when set, else `default`."""
    configured = configured_threads()
    return default if configured is None else configured
