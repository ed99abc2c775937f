"""The embedded default store's writer: one trajectory per JSON line, a file per
project/experiment/step (which file and directory: `trace_proxy/store/layout.py`).

A batch's lines for one file go out in one `write` on an O_APPEND descriptor; a file is
fsync'd when it is closed. A torn last line left by a crash is cut off when the file is next
opened, so readers never see a partial record.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import orjson

from trace_proxy.exporters.base import Capabilities, Exporter
from trace_proxy.store.layout import StoreDirectories, record_names, write_all
from trace_proxy.trajectories.record import (
    Record,
    SpooledTrajectory,
    Trajectory,
    dumps,
)

MAX_OPEN_FILES = 32


class JsonlExporter(Exporter):
    name = "jsonl"
    # a spool line is the store's line (`export_lines`); a line written is found again
    capabilities = Capabilities(writes_spooled_lines=True, tells_exported=True)

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
            write_all(self._open(*names), b"".join(chunk))  # whole lines, one write per file

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
