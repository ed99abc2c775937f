"""A trajectory split by the death of a capture process, read back as one.

When the capture process dies the proxy starts another. What the dead one held in open
trajectories is lost (and counted, `capture_process_lost`); what it had written stays. The new
one cannot know which trajectories it continues: each keyed trajectory it opens without having
seen it carries a restart mark (`trajectories.record.restart_mark`, with the time the proxy
started). Readers (`show`, the viewer, `export`) join a marked record with the record of the
same trajectory written before it in the same store by the same proxy:

- the same run and key: trajectory id, else step, validation, sample index and rollout;
- started at or after the proxy did (a record of an earlier proxy on this store, a rerun of
  the step, is another rollout);
- not ended by the client (`close_reason` `done`): a later trajectory that reuses the key of
  one the client ended is another rollout.

Marks chain: a trajectory that outlived two restarts reads as one record. Parts a proxy
numbers itself (`part` 2, 3: calls after the proxy closed the trajectory) stay parts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

from trace_proxy.trajectories.record import RESTART_SOURCE


def restart_since(record: Mapping[str, Any]) -> float | None:
    """The start of the proxy whose restarted capture process wrote `record`, when it is
    marked so."""
    notes = record.get("annotations")
    for note in notes if isinstance(notes, list) else ():
        if isinstance(note, dict) and note.get("source") == RESTART_SOURCE:
            value = note.get("value")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def identity(
    trajectory_id: Any, validate: Any, step: Any, sample_index: Any, rollout_n: Any
) -> Hashable | None:
    """What makes two records of one run the same trajectory, as the assembler groups calls;
    None for a trajectory with no key (a call of its own)."""
    if isinstance(trajectory_id, str):
        return ("id", bool(validate), step, trajectory_id)
    if sample_index is not None:
        return ("key", bool(validate), step, sample_index, rollout_n)
    return None


def record_identity(record: Mapping[str, Any]) -> Hashable | None:
    key = record.get("key")
    if record.get("record") != "trajectory" or not isinstance(key, dict):
        return None
    return identity(key.get("trajectory_id"), key.get("validate"), key.get("step"),
                    key.get("sample_index"), key.get("rollout_n"))  # fmt: skip


def continues(since: float, first_start: Any, last_close_reason: Any) -> bool:
    """Does a record marked with `since` continue the trajectory whose records so far began
    at `first_start` and whose last one was closed for `last_close_reason`?"""
    started = first_start if isinstance(first_start, (int, float)) else None
    return started is not None and started >= since and last_close_reason != "done"


def rejoined(
    stored: Iterable[tuple[Path, dict[str, Any]]],
) -> list[tuple[Path, list[dict[str, Any]]]]:
    """A run's records in the order read, each with the directory it was read from; a marked
    record is put with the records of the trajectory it continues (and not listed again); a
    trajectory record a store holds twice (a line written again) is taken once."""
    found: list[tuple[Path, list[dict[str, Any]]]] = []
    latest: dict[tuple[Path, Hashable], list[dict[str, Any]]] = {}
    taken: set[tuple[Path, str]] = set()
    for directory, record in stored:
        if record.get("record") == "trajectory" and isinstance(record.get("id"), str):
            if (directory, record["id"]) in taken:
                continue
            taken.add((directory, record["id"]))
        ident = record_identity(record)
        if ident is None:
            found.append((directory, [record]))
            continue
        since = restart_since(record)
        earlier = latest.get((directory, ident))
        if (
            since is not None
            and earlier is not None
            and continues(since, earlier[0].get("start"), earlier[-1].get("close_reason"))
        ):
            earlier.append(record)
            continue
        records = [record]
        latest[(directory, ident)] = records
        found.append((directory, records))
    return found
