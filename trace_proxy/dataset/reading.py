"""The trajectories an export takes from a store, step by step, as `show` and the viewer read them.

A store's runs are listed by `store/readers.py` (an output with replicas read as one store,
its runs grouped by name), and each step is read across every directory of its run at once: a
trajectory whose calls reached several proxies is joined (`replicas.one_per_trajectory`) and a
late reward, an annotation in its step's file, is merged (`annotations.apply_annotations`). An
export holds one step's record heads at a time and one whole record, never a step's records.
Which trajectories it takes is a `Selection`; what it leaves out is counted in a `Tally`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from trace_proxy.store.annotations import apply_annotations
from trace_proxy.store.readers import (
    directory_value,
    file_lines,
    jsonl_files,
    line_at,
    runs,
)
from trace_proxy.store.replicas import joined, one_per_trajectory, store_roots

VALIDATION = ("exclude", "include", "only")  # what `--validation` takes
STATUSES = ("ok", "error", "any")  # what `--status` takes
STEP_FILE = re.compile(r"^(validate-)?step-(-?\d+|none)\.jsonl$")  # store/layout.py's names
NAME_LIMIT = 64 << 10  # bytes of a directory's name file read


class SelectionError(ValueError):
    """A filter that cannot be applied, or a store with nothing to read: the user's to fix."""


@dataclass(frozen=True)
class StepRange:
    """Steps `first` to `last`, both included; an open end is None."""

    first: int | None
    last: int | None

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """`3` (one step), `2:5` (2 to 5), `4:` (4 on) or `:5` (up to 5)."""
        first, colon, last = text.strip().partition(":")
        try:
            low = int(first) if first.strip() else None
            high = (int(last) if last.strip() else None) if colon else low
        except ValueError:
            raise SelectionError(
                f"--step {text!r}: expected a step (3) or a range of steps (2:5, 4:, :5)"
            ) from None
        if colon and low is None and high is None:
            raise SelectionError(f"--step {text!r}: a range needs at least one end")
        if low is not None and high is not None and low > high:
            raise SelectionError(f"--step {text!r}: the range's first step is after its last")
        return cls(low, high)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int) or isinstance(step, bool):
            return False
        return (self.first is None or step >= self.first) and (
            self.last is None or step <= self.last
        )


@dataclass(frozen=True)
class Selection:
    """Which stored trajectories an export takes."""

    steps: StepRange | None = None
    validation: str = "exclude"  # validation rollouts: left out, taken too, or only they
    min_reward: float | None = None  # a bound leaves out trajectories without a reward
    max_reward: float | None = None
    status: str = "ok"  # `ok` leaves out trajectories with a failed call
    run: str | None = None  # `PROJECT/EXPERIMENT`, or an experiment's name

    def __post_init__(self) -> None:
        if self.validation not in VALIDATION:
            raise SelectionError(f"--validation must be one of {', '.join(VALIDATION)}")
        if self.status not in STATUSES:
            raise SelectionError(f"--status must be one of {', '.join(STATUSES)}")
        for name in ("min_reward", "max_reward"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise SelectionError(f"--{name.replace('_', '-')} must be a finite number")
        low, high = self.min_reward, self.max_reward
        if low is not None and high is not None and low > high:
            raise SelectionError("--min-reward is above --max-reward")

    def left_out_by(self, record: dict[str, Any]) -> str | None:
        """Why `record` (late rewards merged) is not taken: the filter's name; None: taken."""
        key = record.get("key") or {}
        validate = bool(key.get("validate"))
        if (self.validation == "exclude" and validate) or (
            self.validation == "only" and not validate
        ):
            return "validation"
        if self.steps is not None and key.get("step") not in self.steps:
            return "step"
        if self.status != "any" and record.get("status") != self.status:
            return "status"
        if self.min_reward is not None or self.max_reward is not None:
            reward = record.get("reward")
            if not isinstance(reward, (int, float)) or isinstance(reward, bool):
                return "reward"
            if self.min_reward is not None and reward < self.min_reward:
                return "reward"
            if self.max_reward is not None and reward > self.max_reward:
                return "reward"
        return None

    def passes_over(self, validate: bool, step: int | None) -> str | None:
        """Why no trajectory of a step file of this kind can be taken (a file is named after
        the step and validation of every record in it); None: it is read."""
        if (self.validation == "exclude" and validate) or (
            self.validation == "only" and not validate
        ):
            return "validation"
        return None if self.steps is None or step in self.steps else "step"


@dataclass
class Tally:
    """What an export read and what it left out, for the summary it prints."""

    taken: int = 0
    left_out: Counter[str] = field(default_factory=Counter)  # trajectories, by filter
    files_passed: Counter[str] = field(default_factory=Counter)  # step files not read, by filter
    notes: Counter[str] = field(default_factory=Counter)  # rows short of something, by what

    def describe(self) -> str:
        reasons = ", ".join(f"{count} by --{name}" for name, count in sorted(self.left_out.items()))
        lines = [f"{self.taken} trajectories taken" + (f"; left out {reasons}" if reasons else "")]
        passed = ", ".join(f"{n} by --{name}" for name, n in sorted(self.files_passed.items()))
        if passed:
            lines.append(f"step files not read: {passed}")
        lines += [f"{count} {what}" for what, count in sorted(self.notes.items())]
        return "\n".join(lines)


@dataclass(frozen=True)
class StepFiles:
    """One step's file in each directory of its run that holds it."""

    run: tuple[str, str]  # the run's project and experiment, as values
    validate: bool
    step: int | None
    paths: list[Path]

    @property
    def size(self) -> int:
        return sum(path.stat().st_size for path in self.paths)


def step_files(store: Path, selection: Selection, tally: Tally | None = None) -> list[StepFiles]:
    """The step files an export of `store` reads, in order: run, then steps in number order,
    training before validation (those passed over counted in `tally`). SelectionError when
    there is no store or no such run."""
    if not store.is_dir():
        raise SelectionError(f"{store} is not a directory (expected a --output of serve or demo)")
    found = runs(store_roots(store), parts=True)
    if not found:
        raise SelectionError(f"{store} holds no stored runs (<project>/<experiment>/*.jsonl)")
    named = {name: _run_values(directories) for name, directories in found.items()}
    chosen = sorted(found)
    if selection.run is not None:
        chosen = [name for name in chosen if _matches(selection.run, named[name])]
        if not chosen:
            known = ", ".join("/".join(named[name]) for name in sorted(found))
            raise SelectionError(f"--run {selection.run!r}: no such run in {store} ({known})")
    files = []
    for name in chosen:
        by_file: dict[str, list[Path]] = {}
        for directory in found[name]:
            for file, _ in jsonl_files(directory):
                by_file.setdefault(file, []).append(directory / file)
        for file, paths in by_file.items():
            match = STEP_FILE.match(file)
            if match is None:
                continue  # events.jsonl, steps.jsonl: no trajectories
            validate, step = bool(match.group(1)), _step(match.group(2))
            reason = selection.passes_over(validate, step)
            if reason is None:
                files.append(StepFiles(named[name], validate, step, paths))
            elif tally is not None:
                tally.files_passed[reason] += 1
    return sorted(
        files, key=lambda f: (f.run, f.step is not None, f.step or 0, f.validate)
    )  # fmt: skip


UNREADABLE = "lines of the store that are not records (not JSON objects), passed over"
HEAD = ("record", "id", "key", "part", "start", "end", "status", "close_reason", "annotations",
        "reward", "score", "labels")  # fmt: skip


def step_trajectories(
    files: StepFiles, selection: Selection, tally: Tally
) -> Iterator[dict[str, Any]]:
    """The trajectories of one step the selection takes, by sample and rollout: late rewards
    merged into the records they name, then a trajectory's parts from several replicas, or
    split by a restarted capture process, joined.

    Like the viewer's index, only each record's head and where its line is are kept while the
    step is chosen and ordered; each taken record is read again as it is yielded, so memory
    holds one step's heads and one record, not the step (a GB of JSON at 32k-token prompts)."""
    stored: list[tuple[Path, dict[str, Any]]] = []
    lines: dict[str, tuple[Path, int, int]] = {}
    for path in files.paths:
        for offset, line in file_lines(path):
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                tally.notes[UNREADABLE] += 1  # as the viewer counts them: the rest still read
                continue
            if record.get("record") == "trajectory" and isinstance(record.get("id"), str):
                lines.setdefault(record["id"], (path, offset, len(line)))
                record = {name: record.get(name) for name in HEAD}
            stored.append((path.parent, record))
    apply_annotations(record for _, record in stored)  # onto each part, whichever replica's
    taken = []
    for head in one_per_trajectory(stored):
        if head.get("record") != "trajectory" or head.get("id") not in lines:
            continue
        reason = selection.left_out_by(head)
        if reason is None:
            taken.append(head)
        else:
            tally.left_out[reason] += 1
    tally.taken += len(taken)
    for head in sorted(taken, key=_position):
        parts = [_read(lines[i], i) for i in head.get("parts") or [head["id"]] if i in lines]
        record = joined(parts)
        record.update({name: head.get(name) for name in ("reward", "score", "labels")})
        yield record


def _read(place: tuple[Path, int, int], ident: str) -> dict[str, Any]:
    """A record read again where it was found (the same line: files are only appended to)."""
    record: dict[str, Any] = orjson.loads(line_at(*place))
    if record.get("id") != ident:
        raise SelectionError(f"{place[0]} changed while it was read (rewritten, not appended)")
    return record


def _run_values(directories: Sequence[Path]) -> tuple[str, str]:
    """A run's project and experiment as the values they are for (their name files)."""
    return (
        directory_value(directories[0].parent, NAME_LIMIT),
        directory_value(directories[0], NAME_LIMIT),
    )


def _matches(wanted: str, run: tuple[str, str]) -> bool:
    return wanted in ("/".join(run), run[1])


def _step(text: str) -> int | None:
    return None if text == "none" else int(text)


def _position(record: dict[str, Any]) -> tuple[int, int, float]:
    key = record.get("key") or {}

    def number(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else -1

    start = record.get("start")
    return (
        number(key.get("sample_index")),
        number(key.get("rollout_n")),
        float(start) if isinstance(start, (int, float)) else 0.0,
    )
