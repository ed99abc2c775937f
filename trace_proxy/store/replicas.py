"""One output, several proxies: each writes a replica directory, and readers take them as one.

A proxy per node (verl's plugin) or per pod (sidecars on a shared filesystem) must never write
another's files, so each writes a store of its own, `<output>/replicas/<name>/` (project and
experiment directories, its spool). `trace-proxy show` and `trace-proxy ui` given `<output>`
read its replicas as one store: a run's records are the union of its replicas' (a trajectory
whose calls reached two proxies under one id is shown as one, `joined`), and a step's summary
is the sum of theirs. `replicas/` is told apart from a project of that name by the name file
every project directory holds (`.trace-proxy-name`). The records of one trajectory that a
restarted capture process split are joined the same way (`restarts.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trace_proxy.store.layout import NAME_FILE
from trace_proxy.store.restarts import rejoined
from trace_proxy.trajectories.prompts import expand_prompts
from trace_proxy.trajectories.record import StepSummary

REPLICAS = "replicas"
SUMMED = tuple(
    f.name for f in dataclasses.fields(StepSummary) if f.type in (int, "int")
)  # the counts of a step summary


def store_roots(root: Path) -> list[Path]:
    """The stores under `root`: each of its replicas when it holds them, else `root` itself."""
    replicas = root / REPLICAS
    if not replicas.is_dir() or replicas.is_symlink() or (replicas / NAME_FILE).exists():
        return [root]
    found = sorted(
        path for path in replicas.iterdir()
        if path.is_dir() and not path.is_symlink() and not path.name.startswith(".")
    )  # fmt: skip
    return found or [root]


def merged_summary(summaries: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """One step's summary from each replica that saw it, as one: the counts added up."""
    merged: dict[str, Any] | None = None
    for summary in summaries:
        if merged is None:
            merged = dict(summary)
            continue
        for name in SUMMED:
            merged[name] = _count(merged.get(name)) + _count(summary.get(name))
    return merged


def one_per_trajectory(stored: Iterable[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A run's records (each with the store directory it was read from) with the records of
    one trajectory that several stores wrote (its calls reached several proxies under one id)
    as one (`joined`), in the order first seen, and so the records of one trajectory a
    restarted capture process split (`restarts.rejoined`); a store's own parts stay parts."""
    by_id: dict[tuple[Any, ...], dict[Path, list[dict[str, Any]]]] = {}
    records: list[list[dict[str, Any]] | tuple[Any, ...]] = []
    for directory, group in rejoined(stored):
        record = group[0]
        key = record.get("key") or {}
        if record.get("record") != "trajectory" or not key.get("trajectory_id"):
            records.append(group)
            continue
        name = (key.get("project"), key.get("experiment"), bool(key.get("validate")),
                key.get("step"), key["trajectory_id"], record.get("part", 1))  # fmt: skip
        found = by_id.setdefault(name, {})
        if directory in found:  # another record of that name in the same store: its own
            records.append(group)
            continue
        if not found:
            records.append(name)
        found[directory] = group
    return [
        joined([r for group in by_id[item].values() for r in group])
        if isinstance(item, tuple)
        else joined(item)
        for item in records
    ]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def joined(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One trajectory from the records several proxies wrote of it (a client whose router is
    not sticky sent its calls to more than one, under one trajectory id): every call with its
    whole prompt (prefix sharing is per record), in the order the calls started, tool spans
    pointing at them, times and counts combined, the close reason of the part that ended last,
    the first reward and score given, the labels added up, the parts' ids in `parts`."""
    if len(parts) == 1:
        return parts[0]
    ordered = sorted(parts, key=lambda part: _number(part.get("start")))
    calls: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    for part in ordered:
        first = len(calls)
        part_calls = [c for c in part.get("calls") or [] if isinstance(c, dict)]
        calls += [{**c, "prompt": p} for c, p in zip(part_calls, expand_prompts(part), strict=True)]
        for tool in part.get("tools") or []:
            asked = tool.get("requested_by")
            tools.append(
                {**tool, "requested_by": asked + first if isinstance(asked, int) else None}
            )
    order = sorted(range(len(calls)), key=lambda i: _number(calls[i].get("start")))
    moved = {old: new for new, old in enumerate(order)}
    summary: dict[str, Any] = {}
    for part in ordered:
        for name, value in (part.get("summary") or {}).items():
            summary[name] = _count(summary.get(name)) + _count(value)
    record = dict(ordered[0])
    record.update(
        calls=[{**calls[old], "index": new} for new, old in enumerate(order)],
        tools=sorted(
            ({**t, "requested_by": moved.get(t["requested_by"])} for t in tools),
            key=lambda t: _number(t.get("start")),
        ),
        start=min(_number(part.get("start")) for part in ordered),
        end=max(_number(part.get("end")) for part in ordered),
        status=next((p["status"] for p in ordered if p.get("status") != "ok"), "ok"),
        close_reason=max(ordered, key=lambda part: _number(part.get("end"))).get("close_reason"),
        summary=summary,
        transcript=None,  # each part's own; the calls hold the text
        parts=[part.get("id") for part in ordered],
    )
    for name in ("reward", "score"):
        record[name] = next((p[name] for p in ordered if p.get(name) is not None), None)
    labels = [p["labels"] for p in ordered if isinstance(p.get("labels"), dict)]
    record["labels"] = {k: v for given in labels for k, v in given.items()}
    return record


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
