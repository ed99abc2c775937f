"""Where the jsonl store keeps a record: a file per project/experiment/step.

Layout under the output directory:
    <project>/<experiment>/step-000003.jsonl           trajectories of training step 3
    <project>/<experiment>/validate-step-000003.jsonl  trajectories of a validation pass
    <project>/<experiment>/step-none.jsonl             trajectories with no step
    <project>/<experiment>/events.jsonl                step events (weight updates, pauses)
    <project>/<experiment>/steps.jsonl                 per-step summaries (seen, kept, dropped)
    rewards that arrive after a trajectory was written: `annotation` lines in its step's file

Project and experiment come from requests, so they are never joined into a path as they are:
each directory is named by `trace_proxy.store.names.store_name` (letters, digits and `-_.+=@`
kept, every other byte `%XX`, a leading `.` encoded, long names cut and hashed), and holds a
`.trace-proxy-name` file with the exact value it is for (see `StoreDirectories`). Ordinary
names read as they are (`Qwen3-8B-grpo/grpo-v2/`); `../x` is `%2E.%2Fx`. Records keep their
values as sent, and readers take them from the records, not from the directory names.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections import OrderedDict
from pathlib import Path

from trace_proxy.store.names import MARK, digest, is_safe_component, store_name
from trace_proxy.trajectories.record import (
    Annotation,
    Record,
    SpooledTrajectory,
    StepEvent,
    StepSummary,
)

log = logging.getLogger(__name__)

NAME_FILE = ".trace-proxy-name"  # in each directory of the store: the value it is named after
CANDIDATES = 8  # names tried for one value, each taken by something else, before giving up
KNOWN_DIRECTORIES = 4096  # decisions kept; one forgotten is made again, the same way
_OURS, _TAKEN, _ABSENT = "ours", "taken", "absent"


def record_names(record: Record | SpooledTrajectory) -> tuple[str, str, str]:
    """The project and experiment a record is stored under (their values), and its file."""
    if isinstance(record, StepEvent):
        return record.project, record.experiment, "events.jsonl"
    if isinstance(record, StepSummary):
        return record.project, record.experiment, "steps.jsonl"
    if isinstance(record, Annotation):
        project, experiment, step_number, validate = (
            record.project, record.experiment, record.step, record.validate
        )  # fmt: skip
    else:
        key = record.key
        project, experiment, step_number, validate = (
            key.project, key.experiment, key.step, bool(key.validate)
        )  # fmt: skip
    # At most 20 digits: a record is JSON with 64-bit integers (and metadata allows 18).
    step = "none" if step_number is None else f"{step_number:06d}"
    return project, experiment, f"{'validate-step-' if validate else 'step-'}{step}.jsonl"


class StoreDirectories:
    """The directory of each (project, experiment): `<root>/<project>/<experiment>`, each named
    by `store_name` and claimed with a `NAME_FILE` holding the value (a JSON string), so two
    values never share one. On a case-insensitive filesystem `GRPO` and `grpo` are one name,
    and a file or link may already have a value's name: the value then gets
    `<name>~<hash of the value>`. A directory without a `NAME_FILE` (an earlier version's) is
    taken over when its name is exactly the value's. Nothing is followed out of the root: a
    symbolic link is never used as a directory, and each directory is checked to resolve under
    the root. The latest decisions are kept (the values come from requests: not all of them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._known: OrderedDict[tuple[Path, str], Path] = OrderedDict()

    def get(self, project: str, experiment: str, create: bool) -> Path | None:
        """The directory, made if `create`; None when it does not exist (and not `create`).
        Asked when a file is opened, not for each write."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        parent = self._child(self.root, project, create)
        return None if parent is None else self._child(parent, experiment, create)

    def forget(self) -> None:
        """Look again: a directory was removed under a running store."""
        self._known.clear()

    def _child(self, parent: Path, value: str, create: bool) -> Path | None:
        known = self._known.get((parent, value))
        if known is not None:
            self._known.move_to_end((parent, value))
            return known
        base = store_name(value)
        for attempt in range(CANDIDATES):
            name = base if attempt == 0 else f"{base}{MARK}{digest(value)}"
            name += f"-{attempt}" if attempt > 1 else ""
            path = parent / name
            state = self._claim(path, value, create) if is_safe_component(name) else _TAKEN
            if state == _ABSENT:
                return None
            if state == _OURS and self._inside(path):
                self._known[(parent, value)] = path
                if len(self._known) > KNOWN_DIRECTORIES:
                    self._known.popitem(last=False)
                return path
            log.warning("jsonl: %s is not the store's directory for %r, trying another name",
                        path, value)  # fmt: skip
        raise OSError(f"no free directory name for {value!r} in {parent}")

    def _claim(self, path: Path, value: str, create: bool) -> str:
        line = (json.dumps(value) + "\n").encode()  # one ASCII line, for any str
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            if not create:
                return _ABSENT
            try:
                os.mkdir(path)
            except FileExistsError:  # made meanwhile by another writer: see what it is
                return self._claim(path, value, create)
            return _OURS if _write_name(path, line) else _TAKEN
        if not stat.S_ISDIR(mode):  # a file, or a symbolic link: never followed
            return _TAKEN
        written = _read_name(path)
        if written is None:  # an earlier version's directory: ours if its name is exactly ours
            if path.name not in os.listdir(path.parent):  # another case of it, here
                return _TAKEN
            return _OURS if not create or _write_name(path, line) else _TAKEN
        # Another writer may be writing its name file: the start of a line, without its end.
        partial = not written.endswith(b"\n") and line.startswith(written)
        return _OURS if written == line or partial else _TAKEN

    def _inside(self, path: Path) -> bool:
        root = os.path.realpath(self.root)
        return os.path.commonpath([root, os.path.realpath(path)]) == root


def _read_name(directory: Path) -> bytes | None:
    """The name file's line; None without one."""
    try:
        fd = os.open(directory / NAME_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # a link or something else unreadable: no value's name file
        return b"\n"
    data = bytearray()
    try:
        while chunk := os.read(fd, 1 << 16):  # a value posted to /rewards may be long
            data += chunk
    except OSError:
        return b"\n"
    finally:
        os.close(fd)
    return bytes(data)


def _write_name(directory: Path, line: bytes) -> bool:
    """Claims `directory` for the value `line` names: False when another value has it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(directory / NAME_FILE, flags, 0o644)
    except FileExistsError:
        return _read_name(directory) == line
    try:
        write_all(fd, line)
    finally:
        os.close(fd)
    return True


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`: `os.write` may take less than it is given."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
