"""Run a service module with some DNS names resolving to 127.0.0.1, the way a headless Service's
name resolves to its pods' addresses in a cluster (tests/k8s/test_mtls.py starts the router with
it, so the router dials `dns:///omni-thinker:PORT` exactly as its pod spec says).

    python -m tests.k8s.dns_shim MODULE [ARGS...]     names in $OMNI_TEST_LOOPBACK_NAMES (comma-separated)
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

_real_getaddrinfo = socket.getaddrinfo
_NAMES = {n.strip() for n in os.environ.pop("OMNI_TEST_LOOPBACK_NAMES", "").split(",") if n.strip()}


def _getaddrinfo(host, *args, **kwargs):
    if isinstance(host, str) and host in _NAMES:
        host = "127.0.0.1"
    return _real_getaddrinfo(host, *args, **kwargs)


if __name__ == "__main__":
    socket.getaddrinfo = _getaddrinfo
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
