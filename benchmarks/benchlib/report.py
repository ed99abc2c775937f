"""Turning cells (one system x mode x concurrency x round) into medians, tables and checks.

Added latency and the throughput ratio are computed per round against the direct cell of the
same round, then the median is taken: a neighbour's burst of CPU on a shared 2-core box then
moves both sides of each comparison, not one system's numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from benchlib.workload import parse_mode

DIRECT = "direct"


@dataclass
class Cell:
    round: int
    mode: str
    concurrency: int
    system: str
    step: int  # X-Rollout-Step of this cell's requests
    load: dict[str, Any]
    wall_s: float  # load process start to end of drain
    proxy_cpu_s: float | None  # the proxy's processes over wall_s (drain included)
    loadgen_cpu_s: float  # the whole load process, start-up included
    upstream_cpu_s: float
    machine_busy_s: float  # every process on the machine over wall_s
    drain_s: float | None = None
    drained: bool = True
    backlog: int | None = None
    dropped: int | None = None  # calls counted as dropped in the store's trajectories
    tries: int = 1  # attempts at this slot (re-run when other processes were busy)

    @property
    def cpu_us_per_request(self) -> float | None:
        if self.proxy_cpu_s is None or not self.load["sent"]:
            return None
        return self.proxy_cpu_s / int(self.load["sent"]) * 1e6

    @property
    def other_cores(self) -> float:
        """Cores used by processes outside this benchmark while the cell ran (noise)."""
        ours = self.loadgen_cpu_s + self.upstream_cpu_s + (self.proxy_cpu_s or 0.0)
        return max(0.0, self.machine_busy_s - ours) / self.wall_s


@dataclass
class Row:
    mode: str
    concurrency: int
    system: str
    p50: float
    p99: float
    rps: float
    added_p50: float | None
    added_p99: float | None
    rps_ratio: float | None
    cpu_us: float | None
    rps_range: tuple[float, float] = (math.nan, math.nan)
    # Slow-upstream modes: latency minus the upstream's own wait, median across rounds.
    overhead_p50: float | None = None
    overhead_p99: float | None = None


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Checks:
    items: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.items.append(Check(name, ok, detail))

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.items)

    def lines(self) -> list[str]:
        return [f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.items]


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def _paired(
    cells: list[Cell], direct: dict[int, Cell], metric: Callable[[Cell, Cell], float]
) -> float | None:
    return _median(metric(c, direct[c.round]) for c in cells if c.round in direct)


def aggregate(cells: list[Cell], systems: list[str]) -> list[Row]:
    """One row per (mode, concurrency, system), in the order the options listed them."""
    rows = []
    groups = dict.fromkeys((c.mode, c.concurrency) for c in cells)
    for mode, concurrency in groups:
        same = [c for c in cells if (c.mode, c.concurrency) == (mode, concurrency)]
        direct = {c.round: c for c in same if c.system == DIRECT}
        for system in systems:
            mine = [c for c in same if c.system == system]
            if mine:
                rows.append(_row(mode, concurrency, system, mine, direct))
    return rows


def _row(
    mode: str, concurrency: int, system: str, mine: list[Cell], direct: dict[int, Cell]
) -> Row:
    rps = [c.load["rps"] for c in mine]
    baseline = system != DIRECT
    # With a slow upstream, what a call cost beyond the upstream's own wait is known call by
    # call; its percentiles compare systems without the spread of the generation times.
    slow = parse_mode(mode).latency_ms is not None
    p50, p99 = ("overhead_p50_ms", "overhead_p99_ms") if slow else ("p50_ms", "p99_ms")
    return Row(
        mode=mode,
        concurrency=concurrency,
        system=system,
        p50=_median(c.load["p50_ms"] for c in mine) or math.nan,
        p99=_median(c.load["p99_ms"] for c in mine) or math.nan,
        rps=_median(rps) or math.nan,
        added_p50=_paired(mine, direct, lambda c, d: c.load[p50] - d.load[p50])
        if baseline
        else None,
        added_p99=_paired(mine, direct, lambda c, d: c.load[p99] - d.load[p99])
        if baseline
        else None,
        rps_ratio=_paired(mine, direct, _ratio) if baseline else None,
        cpu_us=_median(c.cpu_us_per_request for c in mine),
        rps_range=(min(rps), max(rps)),
        overhead_p50=_median(c.load["overhead_p50_ms"] for c in mine) if slow else None,
        overhead_p99=_median(c.load["overhead_p99_ms"] for c in mine) if slow else None,
    )


def _ratio(cell: Cell, direct: Cell) -> float:
    rps: float = cell.load["rps"]
    return rps / direct.load["rps"] if direct.load["rps"] else math.nan


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "-"
    return format(value, ("+" if signed else "") + spec)


def results_table(rows: list[Row]) -> str:
    """The headline table (markdown, also readable as plain text)."""
    head = (
        "| mode | conc | system | p50 ms | p99 ms | req/s (min-max) | added p50 ms | "
        "added p99 ms | req/s vs direct | proxy CPU µs/req |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.concurrency} | {r.system} | {_fmt(r.p50, '.3f')} | "
            f"{_fmt(r.p99, '.3f')} | {_fmt(r.rps, '.0f')} "
            f"({_fmt(r.rps_range[0], '.0f')}-{_fmt(r.rps_range[1], '.0f')}) | "
            f"{_fmt(r.added_p50, '.3f', True)} | {_fmt(r.added_p99, '.3f', True)} | "
            f"{_fmt(r.rps_ratio, '.2f')} | {_fmt(r.cpu_us, '.0f')} |"
        )
    return "\n".join(lines)


def rounds_table(cells: list[Cell]) -> str:
    """Every cell as measured, in run order, with the noise indicators."""
    lines = [
        "| # | round | mode | conc | system | req/s | p50 ms | p99 ms | measured | "
        "load-gen CPU | other CPU (cores) | tries | drain s | dropped |",
        "|" + "---|" * 14,
    ]
    for index, c in enumerate(cells, 1):
        busy = c.load["cpu_s"] / c.load["elapsed_s"]
        lines.append(
            f"| {index} | {c.round} | {c.mode} | {c.concurrency} | {c.system} | "
            f"{c.load['rps']:.0f} | {c.load['p50_ms']:.3f} | {c.load['p99_ms']:.3f} | "
            f"{c.load['measured']} | {busy:.0%} | {c.other_cores:.2f} | {c.tries} | "
            f"{_fmt(c.drain_s, '.2f')} | {'-' if c.dropped is None else c.dropped} |"
        )
    return "\n".join(lines)
