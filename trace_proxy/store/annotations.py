"""A reward that arrives late, merged into the record it names: one rule, wherever applied.

A reward, score or labels posted after a trajectory's record was written is stored beside it
as an `annotation` record; `trace-proxy show` and the viewer merge it into the record when
they read the store, by the rule a trajectory still waiting for its step takes a posted one
with (`trajectories.rewards.merged_outcome`), so each shows the values the others do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trace_proxy.trajectories.rewards import merged_outcome


def apply_annotations(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each `annotation` among `records` merged into the trajectory records it names (changed
    in place), in the order written; the annotations naming none of them are returned."""
    records = list(records)
    by_id = {r.get("id"): r for r in records if r.get("record") == "trajectory"}
    orphans = []
    for note in (r for r in records if r.get("record") == "annotation"):
        targets = [by_id[i] for i in note.get("trajectories") or [] if i in by_id]
        for trajectory in targets:
            trajectory.update(merged_outcome(trajectory, note))
        if not targets:
            orphans.append(note)
    return orphans
