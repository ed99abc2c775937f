"""A reward that arrives late, merged into the record it names: one rule, wherever applied.

A reward, score or labels posted after a trajectory's record was written is stored beside it
as an `annotation` record; `trace-proxy show` and the viewer merge it into the record when
they read the store, and a trajectory still waiting for its step takes a posted one the same
way (trajectories/rewards.py), so each shows the values the others do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

REPLACED = ("reward", "score")  # a value a note gives replaces the record's


def merged_outcome(
    record: Mapping[str, Any],
    note: Mapping[str, Any],
    value: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """`record`'s reward, score and labels once `note` is applied: each of reward and score
    that the note gives replaces the record's, and the note's labels are added over the
    record's, the note's winning. Notes applied in the order they were written: the latest
    wins. `value`, when given, reads what a note gives (None: not given), for a reader that
    takes numbers only."""
    merged = {}
    for name in REPLACED:
        given = note.get(name) if value is None else value(note.get(name))
        merged[name] = record.get(name) if given is None else given
    merged["labels"] = {**(record.get("labels") or {}), **(note.get("labels") or {})}
    return merged


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
