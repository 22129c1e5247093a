"""`make test-vllm` fails when vLLM cannot import (OMNI_REQUIRE_VLLM=1, tests/conftest.py), instead
of skipping all of its tests and exiting green; without the variable the vLLM tests skip with the
reason. A vLLM package that raises on import stands in for a broken install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.thinker.vllm_backend import vllm_available
from tests import conftest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def broken_vllm(tmp_path, monkeypatch) -> Path:
    """A folder holding a `vllm` package whose import fails as a broken native extension does."""
    package = tmp_path / "shim" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise OSError("libvllm_C.so: cannot open shared object file (test shim)")\n')
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(package.parent))
    return package.parent


def test_vllm_available_reports_a_broken_install_with_its_error(broken_vllm):
    ok, detail = vllm_available()
    assert not ok
    assert detail.startswith("OSError: libvllm_C.so"), detail


def test_make_test_vllm_fails_when_vllm_cannot_import(broken_vllm, monkeypatch):
    # make test-vllm runs pytest with OMNI_REQUIRE_VLLM=1 ...
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest-vllm:"):].split("\n\n")[0]
    assert "OMNI_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest" in recipe, recipe
    # ... under which the session's configure hook raises a UsageError (pytest exits 4 with it).
    monkeypatch.setenv("OMNI_REQUIRE_VLLM", "1")
    with pytest.raises(pytest.UsageError, match="OMNI_REQUIRE_VLLM=1 but vLLM does not import: OSError: libvllm_C.so"):
        conftest.pytest_configure(None)
    # Without it (the default suite) the vLLM tests are collected, to skip with the reason.
    monkeypatch.delenv("OMNI_REQUIRE_VLLM")
    conftest.pytest_configure(None)
