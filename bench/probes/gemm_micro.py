"""Figure: docs/performance.md, "Exact batching" (gemm against MKL). Rerun: `.venv/bin/python -m
bench.probes.gemm_micro`. Omni's invariant GEMM against MKL's F.linear, per-row F.linear calls and
one bmm item per row, on one thread, at 1, 4 and 16 rows (thread CPU time per call, us). Checks on
the way that every row of the invariant GEMM equals that row alone, bitwise."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from services.runtime.lm import invariant_gemm

SHAPES = [(512, 512), (1024, 512), (512, 1024), (1536, 512), (2048, 512), (3072, 1024), (768, 2048)]  # [N, K]


def cpu_us(fn, *args, n: int = 30) -> float:
    fn(*args)
    start = time.thread_time()
    for _ in range(n):
        fn(*args)
    return (time.thread_time() - start) / n * 1e6


def per_row(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return [F.linear(x[i:i + 1], w) for i in range(x.shape[0])]


def bmm_items(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(x.shape[0], -1, -1))


def main() -> None:
    torch.set_num_threads(1)
    print(f"kernel: {invariant_gemm.isa()}; thread CPU us per call")
    for n_out, k in SHAPES:
        w = torch.randn(n_out, k)
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            out = invariant_gemm.linear(x, w)
            assert torch.equal(torch.cat([invariant_gemm.linear(x[i:i + 1].clone(), w) for i in range(m)]), out)
            mkl = cpu_us(F.linear, x, w)
            ours = cpu_us(invariant_gemm.linear, x, w)
            rows = cpu_us(per_row, x, w)
            bmm = cpu_us(bmm_items, x, w)
            print(f"N={n_out:5d} K={k:5d} M={m:3d}  mkl {mkl:8.1f}  invariant {ours:8.1f} ({ours / mkl:.2f}x)  "
                  f"rows {rows:8.1f} ({rows / mkl:.2f}x)  bmm {bmm:8.1f} ({bmm / mkl:.2f}x)")


if __name__ == "__main__":
    main()
