"""The embedded default store: one trajectory per JSON line, a file per project/experiment/step.

Layout under the output directory:
    <project>/<experiment>/step-000003.jsonl           trajectories of training step 3
    <project>/<experiment>/validate-step-000003.jsonl  trajectories of a validation pass
    <project>/<experiment>/step-none.jsonl             trajectories with no step
    <project>/<experiment>/events.jsonl                step events (weight updates, pauses)
    <project>/<experiment>/steps.jsonl                 per-step summaries (seen, kept, dropped)
    rewards that arrive after a trajectory was written: `annotation` lines in its step's file
Project and experiment names come from request headers: one that is not a plain file name
('/', a leading '.', control characters, too long) is written percent-encoded (`store_name`),
so no client can make the store write outside its directory.
A batch's lines for one file go out in one `write` on an O_APPEND descriptor; a file is
fsync'd when it is closed. A torn last line left by a crash is cut off when the file is next
opened, so readers never see a partial record.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import orjson

from trace_proxy.trajectories.record import (
    Annotation,
    Record,
    SpooledTrajectory,
    StepEvent,
    StepSummary,
    Trajectory,
    dumps,
)

MAX_OPEN_FILES = 32
# What a name may hold as it is; anything else is percent-encoded, and so is a leading '.'.
_NOT_PLAIN = re.compile(r"[\x00-\x1f\x7f/\\%]|^\.")
MAX_NAME_BYTES = 200  # a file name may have 255; longer ones end in a digest instead


def store_name(name: str) -> str:
    """A project or experiment name as one directory name: the name itself when it is plain
    (every name the options accept is), else percent-encoded, and cut to a prefix and a digest
    of the whole when long."""
    if _NOT_PLAIN.search(name) or not name:
        name = _NOT_PLAIN.sub(lambda m: "".join(f"%{b:02X}" for b in m[0].encode()), name)
        name = name or "%00"
    raw = name.encode("utf-8", "replace")
    if len(raw) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    return raw[: MAX_NAME_BYTES - 17].decode("utf-8", "ignore") + "~" + digest


def record_path(root: Path, record: Record | SpooledTrajectory) -> Path:
    if isinstance(record, StepEvent):
        return root / store_name(record.project) / store_name(record.experiment) / "events.jsonl"
    if isinstance(record, StepSummary):
        return root / store_name(record.project) / store_name(record.experiment) / "steps.jsonl"
    if isinstance(record, Annotation):
        project, experiment, step_number, validate = (
            record.project, record.experiment, record.step, record.validate
        )  # fmt: skip
    else:
        key = record.key
        project, experiment, step_number, validate = (
            key.project, key.experiment, key.step, bool(key.validate)
        )  # fmt: skip
    step = "none" if step_number is None else f"{step_number:06d}"
    prefix = "validate-step-" if validate else "step-"
    return root / store_name(project) / store_name(experiment) / f"{prefix}{step}.jsonl"


class JsonlExporter:
    name = "jsonl"
    writes_spooled_lines = True  # a spool line is the store's line: see `export_lines`

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self._files: OrderedDict[Path, int] = OrderedDict()

    def export(self, records: list[Record]) -> None:
        self.export_lines(records)

    def export_lines(self, records: Sequence[Record | SpooledTrajectory]) -> None:
        """Records, or trajectories still as the spool holds them (written as they are)."""
        lines: dict[Path, list[bytes]] = {}
        for record in records:
            line = record.line if isinstance(record, SpooledTrajectory) else dumps(record)
            lines.setdefault(record_path(self.output, record), []).append(line + b"\n")
        for path, chunk in lines.items():
            _write_all(self._open(path), b"".join(chunk))  # whole lines, one write per file

    def exported_ids(self, records: list[Trajectory]) -> set[str]:
        """Which trajectories already have their line (asked after a crash, for one batch)."""
        present = set()
        by_path: dict[Path, list[Trajectory]] = {}
        for record in records:
            by_path.setdefault(record_path(self.output, record), []).append(record)
        for path, group in by_path.items():
            try:
                data = path.read_bytes()
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

    def _open(self, path: Path) -> int:
        fd = self._files.get(path)
        if fd is not None:
            self._files.move_to_end(path)
            return fd
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        _cut_torn_tail(fd)
        self._files[path] = fd
        if len(self._files) > MAX_OPEN_FILES:
            _, oldest = self._files.popitem(last=False)
            _close(oldest)
        return fd


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
