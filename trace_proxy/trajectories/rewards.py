"""Rewards, scores and labels attached to trajectories by the trainer, at any time.

verl's rollout trace has no reward: the reward is computed after the rollout, in the trainer.
Here the trainer (or a reward worker) posts it to the proxy's admin port, naming the trajectory
by `trajectory_id` or by key (experiment, step, sample_index, rollout_n, validate); `done`
closes an open trajectory at once (a framework that knows when a rollout ended says so). A
trajectory still open or waiting for its step gets the values on its own record; one already
exported gets an `annotation` record next to it that readers apply; a target not seen here
(another replica) is still recorded, so nothing posted is lost.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trace_proxy.trajectories.record import RolloutKey, Trajectory

TARGET_FIELDS = {
    "project": str,
    "experiment": str,
    "step": int,
    "sample_index": int,
    "rollout_n": int,
    "validate": bool,
    "trajectory_id": str,
}
MAX_LABELS = 64
REPLACED = ("reward", "score")  # a value a late note gives replaces the record's


class RewardError(ValueError):
    """A posted reward that cannot be applied; the message says what to fix."""


@dataclass(slots=True)
class Outcome:
    target: dict[str, Any]
    reward: float | None = None
    score: float | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    done: bool = False  # the trajectory has ended: close it now, without waiting for idleness

    @property
    def attaches(self) -> bool:
        """Whether there is a value to record (a `done` alone only closes)."""
        return self.reward is not None or self.score is not None or bool(self.labels)


def parse_outcome(body: Any) -> Outcome:
    if not isinstance(body, dict):
        raise RewardError("the body must be a JSON object")
    target: dict[str, Any] = {}
    for name, kind in TARGET_FIELDS.items():
        if name in body:
            value = body[name]
            if kind is int and (type(value) is not int or value < 0):
                raise RewardError(f"{name!r} must be a non-negative integer")
            if kind is not int and not isinstance(value, kind):
                raise RewardError(f"{name!r} must be a {kind.__name__}")
            target[name] = value
    if "trajectory_id" not in target and "sample_index" not in target:
        raise RewardError("name the trajectory: 'trajectory_id', or key fields with 'sample_index'")
    outcome = Outcome(target)
    for name in ("reward", "score"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RewardError(f"{name!r} must be a number")
            setattr(outcome, name, float(value))
    labels = body.get("labels", {})
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise RewardError(f"'labels' must be an object of at most {MAX_LABELS} entries")
    for name, value in labels.items():
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise RewardError(f"label {name!r} must be a string, number, boolean or null")
    outcome.labels = dict(labels)
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise RewardError("'done' must be true or false")
    outcome.done = done
    if not outcome.attaches and not done:
        raise RewardError("nothing to attach: give 'reward', 'score', 'labels' or 'done'")
    return outcome


def matches(key: RolloutKey, target: Mapping[str, Any]) -> bool:
    for name, value in target.items():
        actual = getattr(key, name)
        if name == "validate":
            actual = bool(actual)
        if actual != value:
            return False
    return True


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


def apply(trajectory: Trajectory, outcome: Outcome) -> None:
    """An outcome onto a trajectory not yet written, as readers merge a late one into its
    record (`merged_outcome`)."""
    merged = merged_outcome(
        {"reward": trajectory.reward, "score": trajectory.score, "labels": trajectory.labels},
        {"reward": outcome.reward, "score": outcome.score, "labels": outcome.labels},
    )
    trajectory.reward, trajectory.score = merged["reward"], merged["score"]
    trajectory.labels = merged["labels"]


class ExportedIndex:
    """The keys of recently exported trajectories, to find the records a late reward is for;
    looked up by trajectory id, or by (experiment, step, sample_index), then filtered.

    Kept small, as it holds an entry per exported trajectory: the key without its `sources`,
    and a lookup maps to one record id (a set only when several share it). About 250 bytes
    an entry; `limit` entries at most (the oldest go first).
    """

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._keys: OrderedDict[str, RolloutKey] = OrderedDict()  # record id -> key
        self._by_lookup: dict[tuple[Any, ...], str | set[str]] = {}

    def add(self, trajectory: Trajectory) -> None:
        key = trajectory.key
        if key.sources:
            key = dataclasses.replace(key, sources=_NO_SOURCES)
        self._keys[trajectory.id] = key
        for lookup in _lookups(key):
            known = self._by_lookup.get(lookup)
            if known is None:
                self._by_lookup[lookup] = trajectory.id
            elif isinstance(known, set):
                known.add(trajectory.id)
            elif known != trajectory.id:
                self._by_lookup[lookup] = {known, trajectory.id}
        while len(self._keys) > self._limit:
            record_id, old = self._keys.popitem(last=False)
            for lookup in _lookups(old):
                known = self._by_lookup.get(lookup)
                if known == record_id:
                    del self._by_lookup[lookup]
                elif isinstance(known, set):
                    known.discard(record_id)
                    if not known:
                        del self._by_lookup[lookup]

    def find(self, target: Mapping[str, Any]) -> list[tuple[str, RolloutKey]]:
        if "trajectory_id" in target:
            lookup: tuple[Any, ...] = ("id", target["trajectory_id"])
        else:
            lookup = (
                "sample",
                target.get("experiment"),
                target.get("step"),
                target["sample_index"],
            )
            if lookup[1] is None or lookup[2] is None:  # not narrowed: filter them all
                return [(r, k) for r, k in self._keys.items() if matches(k, target)]
        known = self._by_lookup.get(lookup)
        ids = {known} if isinstance(known, str) else known or set()
        return [(r, self._keys[r]) for r in sorted(ids) if matches(self._keys[r], target)]


_NO_SOURCES: dict[str, str] = {}


def _lookups(key: RolloutKey) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    if key.trajectory_id is not None:
        found.append(("id", key.trajectory_id))
    if key.sample_index is not None:
        found.append(("sample", key.experiment, key.step, key.sample_index))
    return found
