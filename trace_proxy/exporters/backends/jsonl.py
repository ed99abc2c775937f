"""The embedded default store: one trajectory per JSON line, a file per project/experiment/step.

Layout under the output directory:
    <project>/<experiment>/step-000003.jsonl           trajectories of training step 3
    <project>/<experiment>/validate-step-000003.jsonl  trajectories of a validation pass
    <project>/<experiment>/step-none.jsonl             trajectories with no step
    <project>/<experiment>/events.jsonl                step events (weight updates, pauses)
    <project>/<experiment>/steps.jsonl                 per-step summaries (seen, kept, dropped)
    rewards that arrive after a trajectory was written: `annotation` lines in its step's file
A batch's lines for one file go out in one `write` on an O_APPEND descriptor; a file is
fsync'd when it is closed. A torn last line left by a crash is cut off when the file is next
opened, so readers never see a partial record.

Project and experiment come from requests, so they are never joined into a path as they are:
each directory is named by `trace_proxy.storenames.store_name` (letters, digits and `-_.+=@`
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
from collections.abc import Sequence
from pathlib import Path

import orjson

from trace_proxy.storenames import MARK, digest, is_safe_component, store_name
from trace_proxy.trajectories.record import (
    Annotation,
    Record,
    SpooledTrajectory,
    StepEvent,
    StepSummary,
    Trajectory,
    dumps,
)

log = logging.getLogger(__name__)

MAX_OPEN_FILES = 32
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


def record_path(root: Path, record: Record | SpooledTrajectory) -> Path:
    """Where a record goes while no other value holds its directories' names."""
    project, experiment, file_name = record_names(record)
    return root / store_name(project) / store_name(experiment) / file_name


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
        _write_all(fd, line)
    finally:
        os.close(fd)
    return True


class JsonlExporter:
    name = "jsonl"
    writes_spooled_lines = True  # a spool line is the store's line: see `export_lines`

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.directories = StoreDirectories(self.output)
        self._files: OrderedDict[tuple[str, str, str], int] = OrderedDict()  # by record_names

    def export(self, records: list[Record]) -> None:
        self.export_lines(records)

    def export_lines(self, records: Sequence[Record | SpooledTrajectory]) -> None:
        """Records, or trajectories still as the spool holds them (written as they are)."""
        lines: dict[tuple[str, str, str], list[bytes]] = {}
        for record in records:
            line = record.line if isinstance(record, SpooledTrajectory) else dumps(record)
            lines.setdefault(record_names(record), []).extend((line, b"\n"))  # copied once
        for names, chunk in lines.items():
            _write_all(self._open(*names), b"".join(chunk))  # whole lines, one write per file

    def exported_ids(self, records: list[Trajectory]) -> set[str]:
        """Which trajectories already have their line (asked after a crash, for one batch)."""
        present = set()
        by_names: dict[tuple[str, str, str], list[Trajectory]] = {}
        for record in records:
            by_names.setdefault(record_names(record), []).append(record)
        for (project, experiment, file_name), group in by_names.items():
            directory = self.directories.get(project, experiment, create=False)
            if directory is None:
                continue
            try:
                data = (directory / file_name).read_bytes()
            except FileNotFoundError:
                continue
            data = data[: data.rfind(b"\n") + 1]  # a torn last line is cut off on open
            for record in group:  # a line starts with its id: `{"id":"...",`
                line_start = b'{"id":' + orjson.dumps(record.id) + b","
                if data.startswith(line_start) or b"\n" + line_start in data:
                    present.add(record.id)
        return present

    def close(self) -> None:
        while self._files:
            _, fd = self._files.popitem(last=False)
            _close(fd)

    def _open(self, project: str, experiment: str, file_name: str) -> int:
        names = (project, experiment, file_name)
        fd = self._files.get(names)
        if fd is not None:
            self._files.move_to_end(names)
            return fd
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            fd = os.open(self._directory(project, experiment) / file_name, flags, 0o644)
        except FileNotFoundError:  # its directory was removed while the store ran
            self.directories.forget()
            fd = os.open(self._directory(project, experiment) / file_name, flags, 0o644)
        _cut_torn_tail(fd)
        self._files[names] = fd
        if len(self._files) > MAX_OPEN_FILES:
            _, oldest = self._files.popitem(last=False)
            _close(oldest)
        return fd

    def _directory(self, project: str, experiment: str) -> Path:
        directory = self.directories.get(project, experiment, create=True)
        assert directory is not None  # made when missing
        return directory


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut_torn_tail(fd: int, block: int = 1 << 16) -> None:
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:
        start = max(0, end - block)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            os.ftruncate(fd, start + newline + 1)
            return
        end = start
    os.ftruncate(fd, 0)
