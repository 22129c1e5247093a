"""Commands the tests run (openssl, kubectl): a skip with the reason on a developer's machine, a
failure in CI, so a runner without the tool cannot turn checks into silent skips."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    """Whether this is a CI run (CI=true, as GitHub Actions, GitLab and most CI systems set)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_command(name: str, why: str) -> str:
    """The path of command `name`; without it the test is skipped with the reason on a developer's
    machine, and fails in CI, where a missing tool must not turn checks into silent skips."""
    path = shutil.which(name)
    if path is None:
        message = f"needs the {name} command ({why}); `make setup` installs it where it can (apt-get)"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path
