"""Policy versions compared: which of two is newer, and how far apart two are.

Versions are the strings servers and trainers report. verl's are integers (`global_steps`),
compared by value; any other kind is compared by the order seen: the one seen later is newer,
and how far apart two differing ones are is unknown.
"""

from __future__ import annotations

from typing import Any


def as_number(version: Any) -> int | None:
    """A version as an integer, when it is one (verl's `global_steps`)."""
    if not isinstance(version, str):
        return None
    try:
        return int(version)
    except ValueError:
        return None


def newer(seen: str | None, later: str | None) -> str | None:
    """The newer of the version seen so far and one seen after it."""
    if later is None:
        return seen
    if seen is None:
        return later
    low, high = as_number(seen), as_number(later)
    if low is not None and high is not None:
        return seen if low > high else later
    return later


def distance(older: Any, newer_version: Any) -> int | None:
    """How many versions `newer_version` is past `older`: by value for integers, 0 for the
    same version, None when unknown (a missing or non-integer version)."""
    if not isinstance(older, str) or not isinstance(newer_version, str):
        return None
    if older == newer_version:
        return 0
    low, high = as_number(older), as_number(newer_version)
    return None if low is None or high is None else high - low


def spread(record: dict[str, Any]) -> int | None:
    """How many versions a trajectory record's generation spans past its first:
    `weight_version_max` - `weight_version_min` (verl's trajectory span - 1)."""
    return distance(record.get("weight_version_min"), record.get("weight_version_max"))


def lag(record: dict[str, Any]) -> int | None:
    """How many versions behind the newest the proxy had seen when it closed a trajectory
    record: `weight_version_latest` - `weight_version_max` (the freshest weights it used, as
    verl's `trajectory_staleness` counts, here at close rather than at training)."""
    return distance(record.get("weight_version_max"), record.get("weight_version_latest"))
