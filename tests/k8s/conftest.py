"""Fixtures of the Kubernetes manifest tests: every kustomization rendered once per session."""

from __future__ import annotations

import pytest

from .manifests import KUSTOMIZATIONS, Rendered, find_kubectl, render


@pytest.fixture(scope="session")
def kubectl() -> str:
    try:
        return find_kubectl()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def rendered(kubectl) -> dict[str, Rendered]:
    """kustomization ('base', 'overlays/dev-cpu', 'overlays/gpu') -> its rendered objects."""
    return {name: Rendered(name, render(kubectl, name)) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="session")
def overlays(rendered) -> dict[str, Rendered]:
    """overlay name ('dev-cpu', 'gpu') -> its rendered objects: what users deploy."""
    return {name.removeprefix("overlays/"): r for name, r in rendered.items() if name.startswith("overlays/")}
