"""The viewer's URLs: where a run, a step and a trajectory are, and the way back from a URL's
step segment to the step it names."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote, urlencode

from trace_proxy.ui.index import Entry, Run, StepKey


def run_url(run: Run) -> str:
    project, experiment = quote(run.project_dir, safe=""), quote(run.experiment_dir, safe="")
    return f"/run/{run.store}/{project}/{experiment}"


def trajectory_url(run: Run, trajectory_id: str, raw: bool = False) -> str:
    """A trajectory's page (or its raw record): its id is one path segment, whatever it holds
    (`/`, `?`, `#`), or the query where a segment cannot hold it (`.` and `..`, which every
    URL parser removes)."""
    if trajectory_id in (".", ".."):
        query = {"id": trajectory_id, **({"raw": "1"} if raw else {})}
        return f"{run_url(run)}/t?{urlencode(query)}"
    return f"{run_url(run)}/t/{quote(trajectory_id, safe='')}{'/raw' if raw else ''}"


def ids_query(entries: Sequence[Entry]) -> str:
    return urlencode([("id", e.id) for e in entries])


def step_name(key: StepKey) -> str:
    validate, step = key
    return f"{'validate-' if validate else ''}{'none' if step is None else step}"


def parse_step_name(name: str) -> StepKey | None:
    validate = name.startswith("validate-")
    rest = name.removeprefix("validate-")
    if rest == "none":
        return (validate, None)
    if rest.isdigit() or (rest.startswith("-") and rest[1:].isdigit()):
        return (validate, int(rest))
    return None
