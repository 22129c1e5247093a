"""Stages that share one GPU: CUDA MPS for `omni-serve up --gpu-sharing mps` (docs/gpu.md).

Without MPS, the stage processes on one GPU each hold a CUDA context of their own, and the GPU
time-slices between contexts: a thinker's kernel and a talker's never run at the same time, even
when each fills a fraction of the SMs (a decode step at a small batch does). Under MPS every
process's kernels go through one server's context and run side by side; each process's
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the share of the SMs its kernels may take, so one stage's
large kernels (a long prefill) cannot hold every SM while another's small ones wait.

`start_mps` starts the MPS control daemon in a folder the launcher owns (`nvidia-cuda-mps-control
-d` with CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY there), or joins the one that
CUDA_MPS_PIPE_DIRECTORY names when its control pipe exists, then checks that a CUDA context can
be made through it (a child process, the driver API through ctypes: no torch, well under a second
on a GPU). Where any of that fails (no GPU device asked for, no nvidia-cuda-mps-control, the
daemon or the check failing) it logs one line and returns None: the stack runs without MPS.
`MpsDaemon.stop` quits a daemon it started (`echo quit | nvidia-cuda-mps-control`) and leaves a
joined one alone.
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.base.errors import UserError
from services.base.stages import Stage

MPS_CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV, PERCENT_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class GpuSharing(enum.StrEnum):
    NONE = "none"  # each stage process its own CUDA context: the GPU time-slices between them
    MPS = "mps"  # one MPS server runs every stage's kernels side by side, each capped at its percentage


@dataclass(frozen=True)
class MpsPercent:
    """Each stage's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the share of the SMs its kernels may take.

    NOTE: guesses, not measurements (the first device run measures them against no MPS). They
    sum past 100 on purpose: a cap is no reservation, so the stages overlap where their kernels
    leave SMs free, and none of them can take the whole GPU. The thinker gets the most (its
    prefill is the one large kernel stream; its decode at batch <= 64 is bound by memory, not
    SMs); the talker's decode and 15 code-predictor steps a frame are small latency-bound kernels
    that the first audio waits on, which is what a cap on the others protects; code2wav's
    convolutions come in bursts of a chunk."""

    thinker: int = 60
    talker: int = 50
    code2wav: int = 30

    def __post_init__(self):
        for stage in Stage:
            value = getattr(self, stage.value)
            if not 1 <= value <= 100:
                raise UserError(f"--mps-{stage}-percent must be within 1..100, got {value}")

    def of(self, stage: str) -> int:
        return getattr(self, Stage(stage).value)


@dataclass(frozen=True)
class MpsDaemon:
    """An MPS control daemon the stage processes connect to."""

    pipe_dir: str
    log_dir: str
    owned: bool  # started by the launcher (stop() quits it) or joined (stop() leaves it running)
    control: str = MPS_CONTROL  # the control program, for quit
    folder: str | None = None  # the temporary folder holding both directories, when owned

    def client_env(self, percent: int | None = None) -> dict[str, str]:
        """What a process must have in its environment to run its kernels through this daemon's server."""
        env = {PIPE_ENV: self.pipe_dir}
        if self.log_dir:
            env[LOG_ENV] = self.log_dir
        if percent is not None:
            env[PERCENT_ENV] = str(percent)
        return env

    def stop(self, timeout_s: float = 10.0) -> None:
        """Quit a daemon this launcher started (its server ends once its clients have), then drop its folder."""
        if not self.owned:
            return
        try:
            subprocess.run([self.control], input="quit\n", text=True, capture_output=True, timeout=timeout_s,
                           env=dict(os.environ, **self.client_env()))
        except (OSError, subprocess.TimeoutExpired):
            pass  # a daemon that does not answer dies with the machine's session; the folder goes now
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


# Makes a CUDA context the way a stage's first CUDA call does, through the driver API (libcuda,
# no torch) so the check costs well under a second; exits non-zero with the failing call's error.
_CONTEXT_CHECK = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    sys.exit(f"libcuda.so.1: {exc}")
def call(name, *args):
    code = getattr(cuda, name)(*args)
    if code:
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(text))
        sys.exit(f"{name}: {text.value.decode() if text.value else code}")
device, context, memory = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
call("cuInit", 0)
call("cuDeviceGet", ctypes.byref(device), 0)
call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
call("cuCtxSetCurrent", context)
call("cuMemAlloc_v2", ctypes.byref(memory), ctypes.c_size_t(1 << 20))
call("cuMemFree_v2", memory)
call("cuDevicePrimaryCtxRelease_v2", device)
"""


def check_context(daemon: MpsDaemon, timeout_s: float = 60.0) -> str | None:
    """None when a process under `daemon` makes a CUDA context and allocates on it; else why not."""
    try:
        out = subprocess.run([sys.executable, "-c", _CONTEXT_CHECK], capture_output=True, text=True,
                             timeout=timeout_s, env=dict(os.environ, **daemon.client_env()))
    except subprocess.TimeoutExpired:
        return f"a CUDA context through it took over {timeout_s:.0f} s"
    if out.returncode == 0:
        return None
    return "a CUDA context through it failed: " + (_last_line(out.stderr) or f"exit code {out.returncode}")


def start_mps(device: str, log: Callable[[str], None], control: str = MPS_CONTROL,
              check: Callable[[MpsDaemon], str | None] = check_context,
              environ: Mapping[str, str] = os.environ, wait_s: float = 10.0) -> MpsDaemon | None:
    """The daemon the stage processes will use, or None (one line logged: the stack runs without MPS)."""
    def without(why: str) -> None:
        log(f"--gpu-sharing mps: {why}; running without MPS (the stages' kernels time-slice the GPU)")

    if not device.startswith("cuda"):
        return without(f"the stages run on {device!r}, not cuda")
    joined = environ.get(PIPE_ENV)
    if joined and (Path(joined) / "control").exists():
        daemon = MpsDaemon(joined, environ.get(LOG_ENV, ""), owned=False, control=control)
        why = check(daemon)
        if why is not None:
            return without(f"the MPS control daemon at {PIPE_ENV}={joined}: {why}")
        log(f"MPS: joined the control daemon at {PIPE_ENV}={joined}")
        return daemon
    program = shutil.which(control, path=environ.get("PATH"))
    if program is None:
        return without(f"{control} is not on PATH (it comes with the NVIDIA driver's utilities)")
    folder = tempfile.mkdtemp(prefix="omni-mps-")
    daemon = MpsDaemon(str(Path(folder) / "pipe"), str(Path(folder) / "log"), owned=True, control=program,
                       folder=folder)
    for path in (daemon.pipe_dir, daemon.log_dir):
        os.makedirs(path)
    try:
        out = subprocess.run([program, "-d"], capture_output=True, text=True, timeout=wait_s,
                             env=dict(environ, **daemon.client_env()))
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        return without(f"{control} -d did not start: {type(exc).__name__}: {exc}")
    if out.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        return without(f"{control} -d exited with code {out.returncode}: "
                       f"{_last_line(out.stderr + out.stdout) or 'no output'}")
    deadline = time.monotonic() + wait_s
    while not (Path(daemon.pipe_dir) / "control").exists():
        if time.monotonic() > deadline:
            daemon.stop()
            return without(f"{control} -d made no control pipe in {daemon.pipe_dir} within {wait_s:.0f} s")
        time.sleep(0.05)
    why = check(daemon)
    if why is not None:
        daemon.stop()
        return without(f"the MPS control daemon started, but {why}")
    log(f"MPS: control daemon started ({PIPE_ENV}={daemon.pipe_dir}); stopped with the stack")
    return daemon


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
