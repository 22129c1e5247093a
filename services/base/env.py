"""Settings from the environment: every flag of every process also reads OMNI_<FLAG> (e.g.
OMNI_CHECKPOINT), so the Kubernetes ConfigMaps can set them; flags win over the environment.
Standard library only: every process, the router and the gateway too, reads it."""

from __future__ import annotations

import os


def env_default(name: str, default):
    value = os.environ.get("OMNI_" + name.upper().replace("-", "_"))
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


def env_flag(name: str) -> bool:
    """A boolean flag's default from OMNI_<NAME>: 1/true/yes/on."""
    return str(env_default(name, "")).lower() in ("1", "true", "yes", "on")
