"""The benchmarks' plots: TTFP and throughput against concurrency, one line per system or mode."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Line:
    """One system's (or mode's) results across concurrency levels."""

    label: str
    colour: str
    marker: str
    levels: list[int]
    ttfp_p50: list[float]  # ms
    ttfp_tail: list[float]  # ms, the `tail` percentile
    req_per_s: list[float]
    tail: str = "p90"


def plot_levels(lines: list[Line], path: Path, title: str, floor_ms: float | None = None) -> None:
    """TTFP (p50 and a tail) and throughput against concurrency, one line each, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_ttfp, ax_rps) = plt.subplots(1, 2, figsize=(11, 5))
    for line in lines:
        ax_ttfp.plot(line.levels, line.ttfp_p50, marker=line.marker, color=line.colour, label=f"{line.label} p50")
        ax_ttfp.plot(line.levels, line.ttfp_tail, linestyle=":", color=line.colour, label=f"{line.label} {line.tail}")
        ax_rps.plot(line.levels, line.req_per_s, marker=line.marker, color=line.colour, label=line.label)
    if floor_ms is not None:
        ax_ttfp.axhline(floor_ms, color="tab:green", linestyle="--", linewidth=1,
                        label=f"first-chunk floor {floor_ms:.0f} ms")
    levels = sorted({level for line in lines for level in line.levels})
    for ax, name, ylabel in ((ax_ttfp, "Time to first audio", "TTFP (ms, log)"),
                             (ax_rps, "Throughput", "completed requests / s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    ax_ttfp.set_yscale("log")
    ax_rps.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    handles, labels = ax_ttfp.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plot(report: BenchReport, path: Path) -> None:
    """bench.png of an omni-bench run: one line per system."""
    lines = []
    for system in System:
        rows = sorted((r for r in report.results if r.system is system and r.summary.requests),
                      key=lambda r: r.concurrency)
        if rows:
            colour, marker = STYLE[system]
            lines.append(Line(system.value, colour, marker, [r.concurrency for r in rows],
                              [r.summary.ttfp_ms.p50 for r in rows], [r.summary.ttfp_ms.p90 for r in rows],
                              [r.summary.req_per_s for r in rows]))
    cfg = report.config
    loads = [b.load_1m for b in report.blocks if b.load_1m is not None]
    load = f", load average {min(loads):.1f}-{max(loads):.1f} during the runs" if loads else ""
    title = (f"omni-bench: {report.checkpoint_name}, thinker {cfg.max_new_tokens} / talker "
             f"{cfg.talker_max_new_tokens} tokens, {cfg.device} {cfg.dtype}\n{report.machine.label}{load}")
    plot_levels(lines, path, title, report.floor.floor_ms if report.floor is not None else None)
