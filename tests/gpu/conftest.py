"""Fixtures of the GPU-path tests (all of which but test_graphs_on_cuda.py run on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread (OMNI_TEST_THREADS' count when set): tiny ops on the shared 2-core box are
    much faster so (tests/talker)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads(1))
    yield
    torch.set_num_threads(previous)
