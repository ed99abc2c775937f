"""The plots a page shows, drawn on the server as SVG geometry for the templates: a run's
figures across steps, its samples by policy-version lag, a trajectory's timeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trace_proxy.ui import views
from trace_proxy.ui.formatting import num
from trace_proxy.ui.index import Entry

PLOT_W, PLOT_H, PAD = 300.0, 90.0, 6.0
MAX_BARS = 30  # values of a version histogram; larger ones share the last bar


def step_plots(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Small line plots across steps: reward (mean, with a band of one standard deviation),
    response length and tool calls per trajectory."""
    numbered = [r for r in rows if r["step"] is not None]
    if len(numbered) < 1:
        return []
    plots = []
    for field, title in (
        ("reward_mean", "reward (mean ± sd)"),
        ("length", "response tokens per trajectory"),
        ("tool_calls", "tool calls per trajectory"),
    ):
        points = [(r["step"], r[field], r["reward_std"] or 0.0) for r in numbered
                  if r[field] is not None]  # fmt: skip
        if points:
            plots.append(line_plot(title, points, band=field == "reward_mean"))
    return plots


def version_plots(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """How stale the run's training samples were: how many of them by versions their
    generation spans past its first (max - min), and by versions behind the newest the proxy
    had seen when they closed (latest - max). Only samples whose versions are integers."""
    plots = []
    for field, title, name in (
        ("version_spread", "samples by versions spanned (max - min version)", "version-spread"),
        ("version_lag", "samples by versions behind the newest at close", "version-lag"),
    ):
        values = [v for v in (getattr(e, field) for e in entries) if v is not None]
        if values:
            plots.append(histogram(name, title, values))
    return plots


def histogram(name: str, title: str, values: list[int]) -> dict[str, Any]:
    """A histogram of small integers drawn as SVG bars, one per value from the least."""
    first = min(0, min(values))
    counts: dict[int, int] = {}
    for value in values:
        bucket = min(value, first + MAX_BARS - 1)
        counts[bucket] = counts.get(bucket, 0) + 1
    last = max(counts)
    top = max(counts.values())
    width = (PLOT_W - 2 * PAD) / (last - first + 1)
    bars = []
    for position, value in enumerate(range(first, last + 1)):
        count = counts.get(value, 0)
        height = (PLOT_H - 2 * PAD) * count / top
        shown = f"{value}+" if value == first + MAX_BARS - 1 and value < max(values) else value
        bars.append({
            "x": PAD + position * width + 1, "w": max(1.0, width - 2), "h": height,
            "y": PLOT_H - PAD - height, "value": shown, "count": count,
            "label": f"{shown}: {count} sample{'s' if count != 1 else ''}",
        })  # fmt: skip
    return {"id": name, "title": title, "bars": bars, "w": PLOT_W, "h": PLOT_H,
            "first": first, "last": bars[-1]["value"], "top": top,
            "samples": len(values)}  # fmt: skip


def line_plot(title: str, points: list[tuple[int, float, float]], band: bool) -> dict[str, Any]:
    xs = [p[0] for p in points]
    lows = [p[1] - (p[2] if band else 0) for p in points]
    highs = [p[1] + (p[2] if band else 0) for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(lows), max(highs)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 1, y1 + 1

    def x(step: float) -> float:
        return PAD + (PLOT_W - 2 * PAD) * ((step - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def y(value: float) -> float:
        return PLOT_H - PAD - (PLOT_H - 2 * PAD) * (value - y0) / (y1 - y0)

    dots = [{"x": x(s), "y": y(v), "label": f"step {s}: {num(v)}"} for s, v, _ in points]
    line = " ".join(f"{d['x']:.1f},{d['y']:.1f}" for d in dots)
    area = ""
    if band:
        top = [f"{x(s):.1f},{y(v + sd):.1f}" for s, v, sd in points]
        bottom = [f"{x(s):.1f},{y(v - sd):.1f}" for s, v, sd in reversed(points)]
        area = " ".join(top + bottom)
    return {"title": title, "line": line, "area": area, "dots": dots, "w": PLOT_W, "h": PLOT_H,
            "low": num(y0), "high": num(y1), "first": x0, "last": x1}  # fmt: skip


def timeline(view: views.Trajectory) -> dict[str, Any]:
    width, row = 900.0, 18.0
    total = max(view.duration, max((s.end or s.start for s in view.spans), default=0.0), 1e-6)

    def x(t: float) -> float:
        return 120.0 + (width - 130.0) * max(0.0, t) / total

    bars = []
    for n, span in enumerate(view.spans):
        end = span.end if span.end is not None else total
        label = f"↳ {span.label}" if span.kind == "segment" else f"{span.kind} {span.label}"
        bars.append({
            "span": span, "y": n * row + 2, "x": x(span.start),
            "w": max(1.5, x(end) - x(span.start)),
            "fb": None if span.first_byte is None else x(span.first_byte),
            "label": label,
            "title": f"{label}: {span.start:.3f}s → "
            + ("?" if span.end is None else f"{span.end:.3f}s ({span.end - span.start:.3f}s)")
            + ("" if span.first_byte is None else f", first byte {span.first_byte:.3f}s"),
        })  # fmt: skip
    syncs = [
        {"x": x(sync.at), "before": sync.before, "after": sync.after,
         "title": f"weight sync at {sync.at:.3f}s: version {sync.before} → {sync.after}"}
        for sync in view.syncs
    ]  # fmt: skip
    return {"bars": bars, "width": width, "height": len(bars) * row + 20, "total": total,
            "axis_y": len(bars) * row + 14, "syncs": syncs}  # fmt: skip
