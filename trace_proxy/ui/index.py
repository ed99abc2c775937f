"""The viewer's index of jsonl stores: one small entry per trajectory, by file and byte offset.

Records can be megabytes each and a store millions of them, so the viewer never keeps one: an
`Entry` holds what lists and plots need (key, reward, counts, status) and where the line is,
and a page that shows a record reads its line again (`read_line`). Files are read from the
offset reached so far, complete lines only, so a store a running proxy is still writing is
followed by calling `refresh` again: new steps, trajectories, summaries and late rewards
(`annotation` records) appear without a restart. A file that shrank or was replaced is read
again from its start.

Only directories and regular files found by listing the stores are ever opened (symbolic
links are not followed), and pages name a run by the directory names found, so nothing a URL
says becomes part of a path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from trace_proxy.store.readers import (
    directory_value,
    group_name,
    jsonl_files,
    line_at,
    open_no_link,
    runs,
)
from trace_proxy.store.replicas import merged_summary, store_roots
from trace_proxy.store.restarts import continues, identity, restart_since
from trace_proxy.trajectories import versions
from trace_proxy.trajectories.rewards import merged_outcome

CHUNK = 8 << 20  # bytes read at a time; a longer line doubles it until the line fits
LABELS_CAP = 512  # characters of a trajectory's labels kept in the index
NAME_CAP = 256
REPLAY_LABELS = ("replay_of", "replay_of_project", "replay_of_experiment")  # trace-proxy replay's


@dataclass(slots=True)
class Entry:
    """One stored trajectory record, as lists and plots need it."""

    id: str
    file: int  # position in `StoreIndex.files`
    offset: int
    length: int
    step: int | None
    validate: bool
    sample_index: int | None
    rollout_n: int | None
    group: str  # the GRPO group: its sample index, else its sample hash, else itself
    part: int
    status: str
    close_reason: str
    start: float
    end: float
    reward: float | None
    score: float | None
    labels: str | None  # JSON text, cut at LABELS_CAP
    calls: int
    errors: int
    tool_calls: int
    tool_errors: int
    prompt_tokens: int
    completion_tokens: int
    finish: str | None  # the last call's first output's finish reason
    calls_dropped: int
    drift: int = 0  # calls whose token ids drift (retokenization; the record's `drift`)
    annotated: bool = False  # reward, score or labels came from a later annotation
    trajectory_id: str | None = None  # the key's, when the client gave one
    prompt_hash: str | None = None  # `prompt_hash` of its first call: the same sample at any step
    restart_since: float | None = None  # marked by a restarted capture process (restarts.py)
    # Asynchronous RL (`trajectories/versions.py`): versions its generation spans past the
    # first (max - min), versions behind the newest at close (latest - max), both None when
    # not integers; generated across a weight sync.
    version_spread: int | None = None
    version_lag: int | None = None
    partial: bool = False
    # Records of the same trajectory that other replicas wrote (its calls reached several
    # proxies): shown as one with this entry (`replicas.joined`), counted once.
    others: tuple[Entry, ...] = ()

    @property
    def parts(self) -> list[Entry]:
        return [self, *self.others]


@dataclass
class StepStats:
    """Running sums of one step, kept as entries arrive or their rewards change."""

    trajectories: int = 0
    errors: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    reward_squares: float = 0.0
    completion_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    start: float = math.inf
    end: float = -math.inf

    def add(self, entry: Entry, sign: int = 1) -> None:
        self.trajectories += sign
        self.errors += sign * (entry.status != "ok")
        if entry.reward is not None and math.isfinite(entry.reward):
            self.rewarded += sign
            self.reward_sum += sign * entry.reward
            self.reward_squares += sign * entry.reward * entry.reward
        self.completion_tokens += sign * entry.completion_tokens
        self.turns += sign * entry.calls
        self.tool_calls += sign * entry.tool_calls
        self.tool_errors += sign * entry.tool_errors
        if sign > 0:
            self.start = min(self.start, entry.start)
            self.end = max(self.end, entry.end)

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None

    @property
    def reward_std(self) -> float | None:
        mean = self.reward_mean
        if mean is None:
            return None
        return math.sqrt(max(0.0, self.reward_squares / self.rewarded - mean * mean))

    def per_trajectory(self, total: float) -> float | None:
        return total / self.trajectories if self.trajectories else None


StepKey = tuple[bool, int | None]  # (validate, step)


class Follower(Protocol):
    """What else is kept of each trajectory read (the search's text index), told as it is read."""

    def added(self, run: Run, entry: Entry, record: dict[str, Any]) -> None: ...

    def cleared(self, run: Run) -> None: ...  # the run's files are read again from their start

    def caught_up(self) -> None: ...  # a refresh ended


@dataclass
class Step:
    entries: list[Entry] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)
    summaries: dict[Path, dict[str, Any]] = field(default_factory=dict)  # by directory
    # (file, trajectory) -> its latest entry; made when a record a restarted capture process
    # marked first comes (what it may continue is in the same step file), kept from then on
    _latest: dict[tuple[int, Hashable], Entry] | None = None

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        if self._latest is not None:
            self._remember(entry)

    def latest_of(self, entry: Entry) -> Entry | None:
        """The entry of `entry`'s trajectory read last from the same file, if any."""
        if self._latest is None:
            self._latest = {}
            for earlier in self.entries:
                self._remember(earlier)
        ident = _identity(entry)
        return None if ident is None else self._latest.get((entry.file, ident))

    def _remember(self, entry: Entry) -> None:
        ident = _identity(entry)
        if ident is not None and self._latest is not None:
            self._latest[(entry.file, ident)] = entry

    @property
    def summary(self) -> dict[str, Any] | None:
        """Its step_summary record; the sum of its replicas' when several wrote one."""
        return merged_summary(self.summaries.values())


@dataclass
class FileState:
    path: Path
    number: int  # position in `StoreIndex.files`
    device_inode: tuple[int, int]
    offset: int = 0  # bytes of complete lines read


@dataclass
class Run:
    """One project/experiment of one store: a directory, or one in each of its replicas."""

    store: int
    project_dir: str
    experiment_dir: str
    paths: list[Path]
    project: str
    experiment: str
    files: dict[str, FileState] = field(default_factory=dict)
    steps: dict[StepKey, Step] = field(default_factory=dict)
    by_id: dict[str, Entry] = field(default_factory=dict)
    # (validate, step, trajectory id, part) -> its first entry and the directories that wrote it
    by_trajectory: dict[tuple[Any, ...], tuple[Entry, set[Path]]] = field(default_factory=dict)
    by_prompt: dict[str, list[Entry]] = field(default_factory=dict)  # entries, by prompt_hash
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # notes, by target
    # `trace-proxy replay`'s trajectories of this run, by what each replays: (record id,
    # project, experiment), as their labels name it
    replays: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0  # lines that are not a JSON object
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    drift: int = 0  # trajectories with drifting calls
    joined: int = 0  # records shown as part of another's entry (listed in `by_id` all the same)

    @property
    def ref(self) -> tuple[int, str, str]:
        return (self.store, self.project_dir, self.experiment_dir)

    @property
    def trajectories(self) -> int:
        return len(self.by_id) - self.joined

    def clear(self) -> None:
        """Forget everything read (its files are read again from their start)."""
        self.files, self.steps, self.by_id, self.pending, self.events = {}, {}, {}, {}, []
        self.by_trajectory, self.by_prompt, self.replays = {}, {}, {}
        self.unreadable = self.calls = self.prompt_tokens = self.completion_tokens = 0
        self.errors = self.drift = self.joined = 0

    def time_span(self) -> tuple[float, float] | None:
        starts = [s.stats.start for s in self.steps.values() if s.stats.trajectories]
        ends = [s.stats.end for s in self.steps.values() if s.stats.trajectories]
        return (min(starts), max(ends)) if starts else None

    def step_keys(self) -> list[StepKey]:
        return sorted(self.steps, key=lambda k: (k[0], -1 if k[1] is None else k[1]))


class StoreIndex:
    """Every run of the given stores, followed as they grow. Thread-safe: the server refreshes
    and reads it from worker threads."""

    def __init__(self, stores: Sequence[str | Path], min_interval: float = 1.0) -> None:
        self.stores = [Path(s) for s in stores]
        self.files: list[Path] = []
        self.runs: dict[tuple[int, str, str], Run] = {}
        self.generation = 0  # moves whenever something new was read
        self.min_interval = min_interval
        self._refreshed = -math.inf
        self._lock = threading.RLock()
        self.followers: list[Follower] = []

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def refresh(self, force: bool = False) -> int:
        """Read what was appended since the last call (at most once per `min_interval` unless
        forced); returns the generation."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._refreshed < self.min_interval:
                return self.generation
            self._refreshed = now
            for number, root in enumerate(self.stores):
                for (project_dir, experiment_dir), paths in runs(store_roots(root)).items():
                    ref = (number, project_dir, experiment_dir)
                    run = self.runs.get(ref)
                    if run is None:
                        run = self.runs[ref] = Run(
                            number, project_dir, experiment_dir, [],
                            _dir_value(paths[0].parent), _dir_value(paths[0]),
                        )  # fmt: skip
                    run.paths += [path for path in paths if path not in run.paths]
            for run in self.runs.values():
                self._refresh_run(run)
            for follower in self.followers:
                follower.caught_up()
            return self.generation

    def _refresh_run(self, run: Run) -> None:
        found = [(d / n, info) for d in run.paths for n, info in jsonl_files(d)]
        for file, info in found:
            name = str(file)
            state = run.files.get(name)
            identity = (info.st_dev, info.st_ino)
            moved = state is not None and state.device_inode != identity
            if state is not None and (moved or info.st_size < state.offset):
                run.clear()  # replaced or cut: read every file of the run again
                for follower in self.followers:
                    follower.cleared(run)
                self.generation += 1
                self._refresh_run(run)
                return
            if state is None:
                state = run.files[name] = FileState(Path(name), len(self.files), identity)
                self.files.append(state.path)
            if info.st_size > state.offset:
                self._read_new(run, state, name)

    def _read_new(self, run: Run, state: FileState, name: str) -> None:
        try:
            handle = open_no_link(state.path)
        except OSError:
            return
        with handle:
            size = CHUNK
            while True:
                handle.seek(state.offset)
                data = handle.read(size)
                end = data.rfind(b"\n")
                if end < 0:
                    if len(data) < size:
                        return  # a line still being written
                    size *= 2  # one line longer than a chunk
                    continue
                size = CHUNK
                position = 0
                while position <= end:
                    stop = data.index(b"\n", position)
                    if stop > position:
                        line = data[position:stop]
                        self._add_line(run, state, name, line, state.offset + position)
                    position = stop + 1
                state.offset += end + 1
                self.generation += 1

    def _add_line(self, run: Run, state: FileState, name: str, line: bytes, offset: int) -> None:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            if line.strip():
                run.unreadable += 1
            return
        if not isinstance(record, dict):
            run.unreadable += 1
            return
        kind = record.get("record")
        if kind == "trajectory":
            entry = entry_of(record, state.number, offset, len(line))
            if entry is not None:
                _add_entry(run, entry, record, state.path.parent)
                for follower in self.followers:
                    follower.added(run, entry, record)
            else:
                run.unreadable += 1
        elif kind == "annotation":
            _apply_note(run, record)
        elif kind == "step_summary":
            key = (bool(record.get("validate")), _int_or_none(record.get("step")))
            run.steps.setdefault(key, Step()).summaries[state.path.parent] = record
        elif kind == "event":
            run.events.append({k: record.get(k) for k in ("event", "time", "weight_version",
                                                          "http_status", "route")})  # fmt: skip

    # --- reading -------------------------------------------------------------------------

    def run(self, ref: tuple[int, str, str]) -> Run | None:
        return self.runs.get(ref)

    def replays_of(self, run: Run, entry: Entry) -> list[tuple[Run, Entry]]:
        """The trajectories `trace-proxy replay` recorded of `run`'s `entry`, in every run
        indexed."""
        of = (entry.id, run.project, run.experiment)
        return [
            (other, other.by_id[ident])
            for _, other in sorted(self.runs.items())
            for ident in other.replays.get(of, [])
            if ident in other.by_id
        ]

    def read_line(self, entry: Entry) -> bytes:
        """The stored line of `entry`, read again from its file."""
        return line_at(self.files[entry.file], entry.offset, entry.length)

    def read_record(self, entry: Entry) -> dict[str, Any]:
        """The stored record of `entry` with what later annotations changed applied."""
        record: dict[str, Any] = orjson.loads(self.read_line(entry))
        if entry.annotated:
            record["reward"], record["score"] = entry.reward, entry.score
            if entry.labels is not None:
                try:
                    record["labels"] = json.loads(entry.labels)
                except ValueError:
                    record["labels"] = {"(cut)": entry.labels}
        return record

    def search(self, entries: Sequence[Entry], text: str) -> set[str]:
        """Ids of the entries whose stored line holds `text` (case-insensitive), searched in the
        JSON text: a string value is matched as JSON writes it."""
        needle = orjson.dumps(text)[1:-1]
        if needle.isascii():  # compared as bytes, ASCII letters folded: no decoding

            def holds(data: bytes) -> bool:
                return needle.lower() in data.lower()

        else:
            folded = needle.decode().casefold()

            def holds(data: bytes) -> bool:
                return folded in data.decode("utf-8", "replace").casefold()

        found: set[str] = set()
        by_file: dict[int, list[Entry]] = {}
        for entry in entries:
            by_file.setdefault(entry.file, []).append(entry)
        for number, group in by_file.items():
            try:
                handle = open_no_link(self.files[number])
            except OSError:
                continue
            with handle:
                for entry in sorted(group, key=lambda e: e.offset):
                    if holds(os.pread(handle.fileno(), entry.length, entry.offset)):
                        found.add(entry.id)
        return found


def entry_of(record: dict[str, Any], file: int, offset: int, length: int) -> Entry | None:
    """The index entry of a trajectory record; None when it is not one (no id)."""
    ident = record.get("id")
    if not isinstance(ident, str):
        return None
    key, summary = as_dict(record.get("key")), as_dict(record.get("summary"))
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    tools = [t for t in record.get("tools") or [] if isinstance(t, dict)]
    sample = _int_or_none(key.get("sample_index"))
    group = group_name(key, ident)[: NAME_CAP + 16]
    finish = None
    if calls:
        outputs = calls[-1].get("outputs") or []
        if outputs and isinstance(outputs[0], dict):
            finish = _str_or_none(outputs[0].get("finish_reason"))
    completion = _int(summary.get("completion_tokens"))
    if not completion:
        completion = sum(
            len(o.get("token_ids") or [])
            for c in calls for o in (c.get("outputs") or [])[:1] if isinstance(o, dict)
        )  # fmt: skip
    return Entry(
        id=ident[:NAME_CAP],
        file=file,
        offset=offset,
        length=length,
        step=_int_or_none(key.get("step")),
        validate=bool(key.get("validate")),
        sample_index=sample,
        rollout_n=_int_or_none(key.get("rollout_n")),
        group=sys.intern(group),  # the same few strings in every entry: held once
        part=_int(record.get("part")) or 1,
        status=sys.intern(str(record.get("status"))[:NAME_CAP]),
        close_reason=sys.intern(str(record.get("close_reason"))[:NAME_CAP]),
        start=_float(record.get("start")),
        end=_float(record.get("end")),
        reward=_float_or_none(record.get("reward")),
        score=_float_or_none(record.get("score")),
        labels=_labels_text(record.get("labels")),
        calls=len(calls),
        errors=_int(summary.get("errors")),
        tool_calls=len(tools) or _int(summary.get("tool_calls")),
        tool_errors=sum(1 for t in tools if t.get("error")),
        prompt_tokens=_int(summary.get("prompt_tokens")),
        completion_tokens=completion,
        finish=None if finish is None else sys.intern(finish),
        calls_dropped=_int(summary.get("calls_dropped")),
        drift=_int(summary.get("drift_calls")) or sum(1 for c in calls if c.get("drift")),
        trajectory_id=_str_or_none(key.get("trajectory_id")),
        prompt_hash=prompt_hash(calls[0]) if calls else None,
        restart_since=restart_since(record),
        version_spread=versions.spread(record),
        version_lag=versions.lag(record),
        partial=record.get("partial_rollout") is True,
    )


def prompt_hash(call: dict[str, Any]) -> str | None:
    """A digest of a call's whole prompt (its chat messages' roles and contents, else its token
    ids, else its text): equal for the same sample wherever and whenever it was asked, whatever
    key the client gave. None when the prompt is not stored whole (shared with an earlier call)
    or not at all."""
    prompt = as_dict(call.get("prompt"))
    if prompt.get("prefix_call") is not None:
        return None
    messages = prompt.get("messages")
    if isinstance(messages, list) and messages:
        value: Any = [
            [m.get("role"), m.get("content")] if isinstance(m, dict) else m for m in messages
        ]
        kind = b"messages"
    elif isinstance(prompt.get("token_ids"), list) and prompt["token_ids"]:
        value, kind = prompt["token_ids"], b"token_ids"
    elif isinstance(prompt.get("text"), str) and prompt["text"]:
        value, kind = prompt["text"], b"text"
    else:
        return None
    try:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # a number JSON cannot hold again (a huge integer): no digest
        return None
    return hashlib.blake2b(kind + b"\0" + data, digest_size=8).hexdigest()


def _add_entry(run: Run, entry: Entry, record: dict[str, Any], directory: Path) -> None:
    if entry.id in run.by_id:
        return  # the same record written twice: count it once
    step = run.steps.setdefault((entry.validate, entry.step), Step())
    if entry.restart_since is not None:
        earlier = step.latest_of(entry)
        if earlier is not None and continues(
            entry.restart_since, earlier.start, earlier.close_reason
        ):
            _join(run, step, earlier, entry)  # the rest of a trajectory split by a restart
            return
    if entry.trajectory_id is not None:
        name = (entry.validate, entry.step, entry.trajectory_id, entry.part)
        first, directories = run.by_trajectory.setdefault(name, (entry, set()))
        if directory not in directories and directories:  # another replica's record of it
            _join(run, step, first, entry)
            directories.add(directory)
            return
        directories.add(directory)
    run.by_id[entry.id] = entry
    step.add(entry)
    if entry.prompt_hash is not None:
        run.by_prompt.setdefault(entry.prompt_hash, []).append(entry)
    labels = as_dict(record.get("labels"))
    of = [labels.get(name) for name in REPLAY_LABELS]
    if all(isinstance(value, str) for value in of):
        record_id, project, experiment = (str(value)[:NAME_CAP] for value in of)
        run.replays.setdefault((record_id, project, experiment), []).append(entry.id)
    for note in run.pending.pop(entry.id, []):
        _annotate(entry, note)
    step.stats.add(entry)
    summary = as_dict(record.get("summary"))
    run.calls += entry.calls
    run.prompt_tokens += _int(summary.get("prompt_tokens"))
    run.completion_tokens += entry.completion_tokens
    run.errors += entry.status != "ok"
    run.drift += entry.drift > 0


def _identity(entry: Entry) -> Hashable | None:
    return identity(entry.trajectory_id, entry.validate, entry.step, entry.sample_index,
                    entry.rollout_n)  # fmt: skip


def _join(run: Run, step: Step, first: Entry, other: Entry) -> None:
    """`other` is a part of `first`'s trajectory from another replica, or written after a
    restart of the capture process: one entry, counted once."""
    run.by_id[other.id] = first
    run.joined += 1
    step.stats.add(first, -1)
    first.others = (*first.others, other)
    run.drift -= first.drift > 0
    for name in ("calls", "errors", "tool_calls", "tool_errors", "prompt_tokens",
                 "completion_tokens", "calls_dropped", "drift"):  # fmt: skip
        setattr(first, name, getattr(first, name) + getattr(other, name))
    run.drift += first.drift > 0
    if other.end >= first.end:
        first.close_reason = other.close_reason
    first.partial = first.partial or other.partial
    for name in ("version_spread", "version_lag"):  # the larger of the parts' known values
        known = [v for v in (getattr(first, name), getattr(other, name)) if v is not None]
        setattr(first, name, max(known, default=None))
    first.start, first.end = min(first.start, other.start), max(first.end, other.end)
    if first.status == "ok":
        first.status = other.status
    if first.reward is None:
        first.reward, first.score = other.reward, other.score
    step.stats.add(first)
    run.calls += other.calls
    run.prompt_tokens += other.prompt_tokens
    run.completion_tokens += other.completion_tokens
    for note in run.pending.pop(other.id, []):
        _annotate(first, note)


def _apply_note(run: Run, note: dict[str, Any]) -> None:
    """A reward posted after its trajectory was written: onto the entries it names."""
    for target in note.get("trajectories") or []:
        if not isinstance(target, str):
            continue
        entry = run.by_id.get(target)
        if entry is None:
            run.pending.setdefault(target, []).append(note)
            continue
        stats = run.steps[(entry.validate, entry.step)].stats
        stats.add(entry, -1)
        _annotate(entry, note)
        stats.add(entry)


def _annotate(entry: Entry, note: dict[str, Any]) -> None:
    """`note` merged into `entry`: numbers only (a store is read as it is), and the labels,
    kept as text cut at LABELS_CAP, written again only when the note gives some."""
    labels = note["labels"] if isinstance(note.get("labels"), dict) and note["labels"] else None
    kept = None
    if labels is not None and entry.labels and _is_json_object(entry.labels):
        kept = json.loads(entry.labels)
    merged = merged_outcome(
        {"reward": entry.reward, "score": entry.score, "labels": kept},
        {**note, "labels": labels},
        _float_or_none,
    )
    entry.reward, entry.score = merged["reward"], merged["score"]
    if labels is not None:
        entry.labels = _labels_text(merged["labels"])
    entry.annotated = True


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _labels_text(labels: Any) -> str | None:
    if not isinstance(labels, dict) or not labels:
        return None
    text = orjson.dumps(labels, option=orjson.OPT_SORT_KEYS).decode()
    return text if len(text) <= LABELS_CAP else text[: LABELS_CAP - 1] + "…"


def _dir_value(path: Path) -> str:
    """The value a store directory is for, as the index keeps it."""
    return directory_value(path, 4 * NAME_CAP + 1024)[:NAME_CAP]


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is an object, else an empty one (records are read as they were written)."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float:
    result = _float_or_none(value)
    return 0.0 if result is None else result


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _str_or_none(value: Any) -> str | None:
    return value[:NAME_CAP] if isinstance(value, str) else None
