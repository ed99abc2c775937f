"""One output, several proxies: each writes a replica directory, and readers take them as one.

A proxy per node (verl's plugin) or per pod (sidecars on a shared filesystem) must never write
another's files, so each writes a store of its own, `<output>/replicas/<name>/` (project and
experiment directories, its spool). `trace-proxy show` and `trace-proxy ui` given `<output>`
read its replicas as one store: a run's records are the union of its replicas' (a trajectory
whose calls reached two proxies under one id is one trajectory in two parts), and a step's
summary is the sum of theirs. `replicas/` is told apart from a project of that name by the
name file every project directory holds (`.trace-proxy-name`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trace_proxy.exporters.jsonl import NAME_FILE
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


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
