"""omni-serve's batch-invariant GEMM (invariant_gemm.c) as a float32 CPU `F.linear`.

Every output element is one fixed sequence of operations over its input row and weight row (the C
file's header says which), so a row gets the same bits in a batch of any size, at any position,
beside any other rows, on one thread or many processes; and, since its AVX2 and portable paths run
the same operations, on any x86-64 CPU. It still reads each weight once per call, not once per row.
It is not MKL's GEMM, so its bits are not `F.linear`'s: a comparison with `generate` runs
`generate` through the same op (`services/tools/reference.py`, `gemm=True`).

The shared library is compiled once from the C file (`cc -O3`; -O2 leaves the accumulators in
memory, measured 2-3x slower) into a cache folder keyed by the source's hash, or taken prebuilt
from next to this file (`make setup` and the image build put it there). Without a compiler the
op is unavailable: `load()` returns None and says why, and callers keep their per-row path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("invariant_gemm.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off", "-lm"]


def _library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return f"omni_invariant_gemm-{digest}.so"


def prebuilt_path() -> Path:
    return SOURCE.with_name(_library_name())


def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "omni-serve" / _library_name()


def build(dest: Path) -> Path:
    """Compile the C file to `dest` (atomically: concurrent stage processes may build at once)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the invariant GEMM")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        subprocess.run([compiler, *_FLAGS, "-o", str(out), str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(out, dest)
    return dest


ELEMENTWISE = ("sigmoid", "silu", "cos", "sin")  # the ops the C file computes one element at a time, alone


class _Library:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        self.isa = int(lib.omni_gemm_isa())
        gemm = lib.omni_gemm_f32
        size = ctypes.c_ssize_t
        gemm.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, ctypes.c_void_p, ctypes.c_void_p, size,
                         size, size, size, ctypes.c_int]
        gemm.restype = None
        self.gemm = gemm  # ctypes releases the GIL for the call
        self.elementwise = {}  # name -> omni_<name>_f32(x, out, n)
        for name in ELEMENTWISE:
            function = getattr(lib, f"omni_{name}_f32")
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size]
            function.restype = None
            self.elementwise[name] = function
        self.path = path


_unavailable: list[str] = []  # why load() found no library (at most one entry)


@functools.cache
def load() -> _Library | None:
    """The library, built on first use if needed; None (and `unavailable_reason()`) without one."""
    for path in (prebuilt_path(), cache_path()):
        if path.is_file():
            try:
                return _Library(path)
            except OSError as e:
                log.warning("invariant GEMM at %s does not load (%s); rebuilding", path, e)
    try:
        return _Library(build(cache_path()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _unavailable.append(detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__)
        log.warning("invariant GEMM unavailable: %s", _unavailable[-1])
        return None


def unavailable_reason() -> str | None:
    load()
    return _unavailable[0] if _unavailable else None


def isa() -> str:
    lib = load()
    return "unavailable" if lib is None else ("avx2+fma" if lib.isa == 2 else "portable")


def covers(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Float32 CPU tensors outside autograd, a [N, K] weight with contiguous rows."""
    return (input.dtype == torch.float32 and weight.dtype == torch.float32 and input.device.type == "cpu"
            and weight.device.type == "cpu" and weight.ndim == 2 and weight.stride(1) == 1 and input.ndim >= 1
            and (bias is None or (bias.dtype == torch.float32 and bias.ndim == 1))
            and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)))


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(input [..., K], weight [N, K], bias [N]) -> [..., N] through the invariant GEMM
    (the caller checks `covers` and that `load()` has a library)."""
    lib = load()
    n_out, k = weight.shape
    if input.shape[-1] != k:
        raise RuntimeError(f"linear: input has {input.shape[-1]} features, weight {k}")
    rows = input.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
    if rows.shape[0] and n_out:
        lib.gemm(rows.data_ptr(), rows.stride(0) if rows.shape[0] > 1 else k, weight.data_ptr(), weight.stride(0),
                 None if bias is None else bias.data_ptr(), out.data_ptr(), n_out, rows.shape[0], n_out, k, lib.isa)
    return out.view(*input.shape[:-1], n_out)


def elementwise(name: str, input: torch.Tensor) -> torch.Tensor:
    """One of `ELEMENTWISE` over a float32 CPU tensor (`covers_elementwise`), each element by the C
    file's scalar function of its own input: the same bits at any size and place."""
    source = input.contiguous()
    out = torch.empty_like(source)
    if source.numel():
        load().elementwise[name](source.data_ptr(), out.data_ptr(), source.numel())
    return out


def covers_elementwise(input: torch.Tensor) -> bool:
    return (input.dtype == torch.float32 and input.device.type == "cpu"
            and not (torch.is_grad_enabled() and input.requires_grad))


def main() -> None:
    """`python -m services.runtime.lm.invariant_gemm`: build the library next to the source (make setup)."""
    path = build(prebuilt_path())
    kernel = "avx2+fma" if _Library(path).isa == 2 else "portable"
    print(f"built {path} (the {kernel} kernel on this CPU)")


if __name__ == "__main__":
    main()
