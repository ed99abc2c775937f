"""PNG plots of an overhead run: latency percentiles and throughput, per system and concurrency.

matplotlib is optional (`pip install matplotlib`); without it no plot is drawn and RESULTS.md
says so.
"""

from __future__ import annotations

from pathlib import Path

from benchlib.report import Row
from benchlib.workload import parse_mode

COLORS = {"direct": "black", "trace-proxy": "tab:blue", "trace-proxy-unrecorded": "tab:cyan",
          "nginx": "tab:green", "litellm": "tab:red"}  # fmt: skip


def overhead_plots(rows: list[Row], directory: Path) -> list[Path]:
    """latency-vs-concurrency and throughput plots next to RESULTS.md; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    modes = list(dict.fromkeys(r.mode for r in rows))
    systems = list(dict.fromkeys(r.system for r in rows))
    latency = directory / "overhead-latency.png"
    figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for axis, mode in zip(axes[0], modes, strict=True):
        # With a slow upstream its wait would hide the proxies: plot what is left of it.
        slow = parse_mode(mode).latency_ms is not None
        for system in systems:
            mine = sorted((r for r in rows if r.mode == mode and r.system == system),
                          key=lambda r: r.concurrency)  # fmt: skip
            x = [r.concurrency for r in mine]
            color = COLORS.get(system)
            p50 = [r.overhead_p50 if slow else r.p50 for r in mine]
            p99 = [r.overhead_p99 if slow else r.p99 for r in mine]
            axis.plot(x, p50, "o-", color=color, label=f"{system} p50")
            axis.plot(x, p99, "s--", color=color, label=f"{system} p99")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("concurrency (closed loop)")
        axis.set_ylabel("latency minus the upstream's wait, ms" if slow else "latency, ms")
        axis.set_title(f"{mode}: latency percentiles")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(latency, dpi=100)
    plt.close(figure)

    throughput = directory / "overhead-throughput.png"
    cells = sorted(dict.fromkeys((r.mode, r.concurrency) for r in rows))
    figure, axis = plt.subplots(figsize=(max(6, 1.8 * len(cells)), 4.5))
    width = 0.8 / max(1, len(systems))
    for index, system in enumerate(systems):
        by_cell = {(r.mode, r.concurrency): r.rps for r in rows if r.system == system}
        positions = [i + index * width for i in range(len(cells))]
        axis.bar(positions, [by_cell.get(c, 0) for c in cells], width, label=system,
                 color=COLORS.get(system))  # fmt: skip
    axis.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(cells))])
    axis.set_xticklabels([f"{mode} c={c}" for mode, c in cells])
    axis.set_yscale("log")
    axis.set_ylabel("requests per second")
    axis.set_title("throughput")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(throughput, dpi=100)
    plt.close(figure)
    return [latency, throughput]
