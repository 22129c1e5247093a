"""Fixtures of the GPU-path tests (all of which but test_graphs_on_cuda.py run on CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for every GPU test module (tests/conftest.py's one_torch_thread)."""
