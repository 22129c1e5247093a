"""The one way tests start the real stack: every stage and the router as processes on loopback
ports (services/tools/launcher.py), one torch thread each (OMNI_TEST_THREADS' count when set:
tests/threads.py), logs unprefixed. Fixtures in the conftest files call `stack_of`; nothing else in
the tests starts processes of the pipeline."""

from __future__ import annotations

from pathlib import Path

from services.tools.launcher import Stack, StackOptions
from tests.threads import torch_threads


def stack_of(checkpoint: str | Path, **options) -> Stack:
    """A `Stack` (a context manager) on `checkpoint` with the tests' defaults; `options` are
    StackOptions fields (replicas, per-process args, TLS)."""
    return Stack(StackOptions(checkpoint=str(checkpoint), port=0, threads=torch_threads(1), log_prefix=False, **options))
