"""bench.png: TTFP and throughput against concurrency, one line per system."""

from __future__ import annotations

from pathlib import Path

from bench.report import BenchReport
from bench.systems import System

STYLE = {  # system -> (colour, marker)
    System.REFERENCE: ("tab:gray", "s"),
    System.REFERENCE_BATCHED: ("tab:orange", "^"),
    System.PIPELINE: ("tab:blue", "o"),
    System.PIPELINE_UNBATCHED: ("tab:purple", "v"),
    System.PIPELINE_GEMM: ("tab:cyan", "P"),
    System.GATEWAY: ("tab:green", "D"),
}


def write_plot(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_ttfp, ax_rps) = plt.subplots(1, 2, figsize=(11, 5))
    for system in System:
        rows = sorted((r for r in report.results if r.system is system and r.summary.requests),
                      key=lambda r: r.concurrency)
        if not rows:
            continue
        colour, marker = STYLE[system]
        levels = [r.concurrency for r in rows]
        p50 = [r.summary.ttfp_ms.p50 for r in rows]
        p90 = [r.summary.ttfp_ms.p90 for r in rows]
        ax_ttfp.plot(levels, p50, marker=marker, color=colour, label=f"{system.value} p50")
        ax_ttfp.plot(levels, p90, linestyle=":", color=colour, label=f"{system.value} p90")
        ax_rps.plot(levels, [r.summary.req_per_s for r in rows], marker=marker, color=colour, label=system.value)
    if report.floor is not None:
        ax_ttfp.axhline(report.floor.floor_ms, color="tab:green", linestyle="--", linewidth=1,
                        label=f"first-chunk floor {report.floor.floor_ms:.0f} ms")
    levels = sorted({r.concurrency for r in report.results})
    for ax, title, ylabel in ((ax_ttfp, "Time to first audio", "TTFP (ms, log)"),
                              (ax_rps, "Throughput", "completed requests / s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_ttfp.set_yscale("log")
    ax_rps.set_ylim(bottom=0)
    cfg = report.config
    loads = [b.load_1m for b in report.blocks if b.load_1m is not None]
    load = f", load average {min(loads):.1f}-{max(loads):.1f} during the runs" if loads else ""
    fig.suptitle(f"omni-bench: {report.checkpoint_name}, thinker {cfg.max_new_tokens} / talker "
                 f"{cfg.talker_max_new_tokens} tokens, {cfg.device} {cfg.dtype}\n{report.machine.label}{load}",
                 fontsize=9)
    handles, labels = ax_ttfp.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
