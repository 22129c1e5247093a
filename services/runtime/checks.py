"""Exact mode's start-up checks, run beside serving, their verdicts kept on disk.

NOTE: why beside serving. A check asks the machine's kernels whether a faster plan keeps every
request's bits (services/runtime/lm/invariance.py, services/code2wav/plan.py). At the real widths
code2wav's check decodes hundreds of frames through the real vocoder (281 s on 2 cores before it
was cut to what it must decode; docs/performance.md), and a stage that checked before serving
could not start under `omni-serve up`, nor restart quickly in a pod. Every stage has a plan that
is invariant by construction (one request a call, per-row kernels), so:

- `StartupCheck.start()` adopts a verdict kept on disk for the same key at once, or starts the
  check on a thread of its own at the lowest CPU priority (nice 19: on a busy machine the engine
  wins every core it wants) and returns None: the engine serves on its by-construction plan;
- the engine asks `ended()` on its own thread between steps and adopts the faster plan when the
  verdict is there: the check never holds the engine, and a plan changes only between steps. A
  plan adopted mid-stream changes no bits, because a check adopts only what gives each request
  the bits it gets alone, which is what the by-construction plan gives it;
- a check that raises leaves the by-construction plan in place, logged once, and keeps nothing.

`--startup-checks before-serving` runs the check before the engine takes a request (the old
behaviour; in-process engines, tests and the benchmark's floor default to it).

Verdicts on disk (`--check-cache`, default ~/.cache/omni-serve/checks): one JSON file per key. The
key is everything a verdict depends on: the CPU (model and flags), torch (version and build), the
kernel capability torch dispatches to (ATEN_CPU_CAPABILITY), the thread count, and the check's own
shapes (what it runs, not the weights' values: bitwise invariance is a property of a kernel and
its shapes). A file whose key differs (another machine's, copied in) or that does not parse is
ignored and the check runs again; a folder that cannot be written costs only the reuse.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from services.runtime.model.settings import CheckSettings

log = logging.getLogger(__name__)

FORMAT = 1  # a verdict file's layout; a file of another format is checked again
V = TypeVar("V")


class CheckStopped(BaseException):
    """Raised in a check's thread when its engine closes (a BaseException: the checks' guards,
    which turn any Exception into "not invariant here", let it through)."""


class CheckState(enum.StrEnum):
    """Where an engine's exact-mode plan came from (omni_exact_check)."""

    NONE = "none"  # nothing to check (exact mode off, or no faster plan exists)
    RUNNING = "running"  # the check runs beside serving; the plan is the by-construction one
    CHECKED = "checked"  # the plan is this process's check's verdict
    CACHED = "cached"  # the plan is a verdict kept on disk for this key
    FAILED = "failed"  # the check raised: the by-construction plan stays


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu() -> tuple[str, str]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; the platform's names elsewhere."""
    model, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "Processor") and model == platform.processor():
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
                elif not line.strip() and flags:
                    break
    except OSError:
        pass
    return model, flags


def machine() -> dict[str, Any]:
    """What any verdict depends on besides its shapes, read in the process that runs the engine
    (its thread count set)."""
    model, flags = _cpu()
    return {"cpu": model, "cpu_flags": _digest(" ".join(sorted(flags.split()))), "arch": platform.machine(),
            "torch": torch.__version__, "torch_build": _digest(torch.__config__.show()),
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "mkldnn": bool(torch.backends.mkldnn.enabled)}


def _normal(value):
    """The value as JSON gives it back (tuples as lists), so a key read from disk compares equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


class VerdictCache:
    """Verdicts in `folder`, one file per key."""

    def __init__(self, folder: str):
        self.folder = Path(folder).expanduser()

    def path(self, key: dict) -> Path:
        return self.folder / f"{str(key['check']).replace(' ', '-')}-{_digest(json.dumps(_normal(key)))}.json"

    def get(self, key: dict) -> dict | None:
        """The verdict kept for `key`, or None (none kept, or a file that is not one for this key)."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s: ignoring an unreadable verdict file %s (%s); checking again", key["check"], path, exc)
            return None
        if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("key") == _normal(key)
                and isinstance(data.get("verdict"), dict)):
            log.warning("%s: ignoring %s, a verdict for another key or format; checking again", key["check"], path)
            return None
        return data["verdict"]

    def put(self, key: dict, verdict: dict) -> None:
        """Keep `verdict` (written whole, then renamed into place: a reader never sees half a file)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_text(json.dumps({"format": FORMAT, "key": _normal(key), "verdict": verdict},
                                          indent=1, sort_keys=True))
            os.replace(partial, path)
        except OSError as exc:
            log.warning("%s: could not keep the verdict in %s (%s); a restart checks again", key["check"], path, exc)


class StartupCheck(Generic[V]):
    """One engine's check: `run()` gives the verdict (a faster plan, or the reasons there is none),
    `encode`/`decode` turn it into JSON and back. The engine calls `start()` once and `ended()`
    between steps, on its own thread."""

    def __init__(self, name: str, shapes: dict, run: Callable[[], V], encode: Callable[[V], dict],
                 decode: Callable[[dict], V], settings: CheckSettings):
        self.name = name
        self.key = {"check": name, **shapes, **machine()}
        self._run, self._encode, self._decode = run, encode, decode
        self.settings = settings
        self.cache = VerdictCache(settings.cache) if settings.cache else None
        self.state = CheckState.NONE
        self.seconds = 0.0
        self.verdict: V | None = None  # the check's (None while it runs, or where it failed)
        self._done = threading.Event()
        self._taken = False
        self._thread: threading.Thread | None = None

    def start(self) -> V | None:
        """A kept verdict (adopt it now), or, before serving, this check's; None while it runs beside
        serving, or when it failed."""
        if (kept := self._kept()) is not None:
            self.state, self._taken = CheckState.CACHED, True
            self._done.set()
            log.info("%s: the verdict kept for this machine (%s) is used; nothing to check", self.name,
                     self.cache.path(self.key))
            return kept
        self.state = CheckState.RUNNING
        if not self.settings.background:
            self._check()
            self._taken = True
            return self.verdict
        log.info("%s: serving on the plan that is invariant by construction while the check runs beside it", self.name)
        self._thread = threading.Thread(target=self._check, args=(True,), name=f"{self.name} check", daemon=True)
        self._thread.start()
        return None

    def ended(self) -> bool:
        """True once: at the first call after the check beside serving ended (`verdict` holds what it
        found, None where it failed)."""
        if self._taken or not self._done.is_set():
            return False
        self._taken = True
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Until the check ended (tests and tools that want the faster plan before they measure)."""
        return self._done.wait(timeout)

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop a check still running beside serving (the engine is closing) and wait for its thread;
        True once no check thread runs. The check's thread gets CheckStopped at its next Python line,
        i.e. after the kernel it is in returns: a process must not exit with that thread inside
        torch (the C++ runtime aborts: "terminate called without an active exception")."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        if not self._done.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CheckStopped))
        thread.join(timeout)
        if thread.is_alive():
            log.warning("%s: the check did not stop within %.0f s of the engine closing", self.name, timeout)
        return not thread.is_alive()

    def _kept(self) -> V | None:
        if self.cache is None or (data := self.cache.get(self.key)) is None:
            return None
        try:
            return self._decode(data)
        except Exception as exc:  # noqa: BLE001 - any malformed verdict: check again
            log.warning("%s: ignoring a malformed verdict in %s (%s: %s); checking again", self.name,
                        self.cache.path(self.key), type(exc).__name__, exc)
            return None

    def _check(self, beside: bool = False) -> None:
        if beside:
            _lowest_priority()
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                verdict = self._run()
            encoded = self._encode(verdict)
        except CheckStopped:
            log.info("%s: the check stopped as the engine closed; nothing kept", self.name)
        except Exception:  # noqa: BLE001 - a check that cannot run leaves the by-construction plan
            log.exception("%s: the check failed; the plan invariant by construction stays", self.name)
            self.state = CheckState.FAILED
        else:
            self.verdict, self.state = verdict, CheckState.CHECKED
            if self.cache is not None:
                self.cache.put(self.key, encoded)
        finally:
            self.seconds = time.perf_counter() - started
            self._done.set()


def _lowest_priority() -> None:
    """This thread (and the OpenMP workers it starts, which inherit it) at nice 19."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # not Linux, or not allowed: it runs at the engine's priority
        log.debug("could not lower the check thread's priority", exc_info=True)
