"""Which recorded trajectories to replay: by record id, or a step's, from one run of a store.

The store is read the one way `show` and the viewer read it (`store/readers.py`): runs found by
listing, replicas' runs taken as one, only complete records. A run is named by its project and
experiment, as the viewer shows them (`PROJECT/EXPERIMENT`, or the experiment alone when that
is unambiguous); nothing given on the command line becomes a path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_proxy.store.readers import directory_value, run_records, runs
from trace_proxy.store.replicas import store_roots

NAME_LIMIT = 2048  # bytes of a directory's name file read: a value is at most 256 characters


class ReplayError(Exception):
    """What the user asked cannot be done; the message says why in one line."""


@dataclass
class RecordedRun:
    """One run of the store: its names and its directories (one per replica)."""

    project: str
    experiment: str
    directories: list[Path]

    @property
    def name(self) -> str:
        return f"{self.project}/{self.experiment}"


def recorded_runs(store: Path) -> list[RecordedRun]:
    """Every run of the store at `store` (its replicas' read as one), records not yet read."""
    if not store.is_dir():
        raise ReplayError(f"no store at {store}: not a directory")
    found = []
    for _, directories in sorted(runs(store_roots(store)).items()):
        project = directory_value(directories[0].parent, NAME_LIMIT)
        experiment = directory_value(directories[0], NAME_LIMIT)
        found.append(RecordedRun(project, experiment, directories))
    if not found:
        raise ReplayError(f"no runs in the store at {store}")
    return found


def trajectory_records(run: RecordedRun) -> Iterator[dict[str, Any]]:
    """The run's trajectory records, file by file (one file in memory at a time)."""
    for directory in run.directories:
        for _, record in run_records(directory):
            if record.get("record") == "trajectory":
                yield record


def select(
    store: Path,
    *,
    run_name: str | None,
    trajectory_ids: Sequence[str],
    step: int | None,
    validation: bool = False,
) -> tuple[RecordedRun, list[dict[str, Any]]]:
    """The run and the trajectories to replay: those whose record id (or key's trajectory id)
    is given, or every trajectory of `step` (its validation ones with `validation`). Only
    those are kept in memory."""
    if bool(trajectory_ids) == (step is not None):
        raise ReplayError("name what to replay: --trajectory ID (repeatable) or --step N")
    candidates = recorded_runs(store)
    if run_name is not None:
        candidates = [r for r in candidates if run_name in (r.name, r.experiment)]
        if not candidates:
            raise ReplayError(f"no run {run_name!r} in the store at {store}")
    if len(candidates) > 1 and (step is not None or run_name is not None):
        raise ReplayError(_several(candidates))
    wanted = set(trajectory_ids)
    by_id: list[tuple[RecordedRun, dict[str, Any]]] = []
    by_key: list[tuple[RecordedRun, dict[str, Any]]] = []
    for run in candidates:
        for record in trajectory_records(run):
            if step is not None:
                if _in_step(record, step, validation):
                    by_id.append((run, record))
            elif record.get("id") in wanted:
                by_id.append((run, record))
            elif _key(record).get("trajectory_id") in wanted:
                by_key.append((run, record))
    # A record id names one record; a trajectory id only when no record has that id (a
    # replayed trajectory's id is its recorded one's record id).
    named = {record.get("id") for _, record in by_id}
    found = by_id + [(r, t) for r, t in by_key if _key(t).get("trajectory_id") not in named]
    if not found:
        if step is not None:
            kind = "validation trajectories" if validation else "trajectories"
            raise ReplayError(f"no {kind} of step {step} in {candidates[0].name}")
        raise ReplayError(f"no trajectory {', '.join(trajectory_ids)} in the store at {store}")
    runs_found = list({id(run): run for run, _ in found}.values())
    if len(runs_found) > 1:
        raise ReplayError(_several(runs_found))
    picked = [record for _, record in found]
    seen = named | {_key(t).get("trajectory_id") for t in picked}
    missing = [i for i in trajectory_ids if i not in seen]
    if missing:
        raise ReplayError(f"no trajectory {', '.join(missing)} in {runs_found[0].name}")
    return runs_found[0], picked


def _key(record: dict[str, Any]) -> dict[str, Any]:
    key = record.get("key")
    return key if isinstance(key, dict) else {}


def _in_step(record: dict[str, Any], step: int, validation: bool) -> bool:
    key = _key(record)
    return key.get("step") == step and bool(key.get("validate")) == validation


def _several(found: Sequence[RecordedRun]) -> str:
    names = ", ".join(run.name for run in found[:10])
    return f"the store holds several runs ({names}): name one with --run PROJECT/EXPERIMENT"
