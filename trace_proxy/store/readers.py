"""Reading a jsonl store back: its runs, their files and the complete records in them.

`trace-proxy show` and the viewer walk a store the one way its layout (layout.py) writes it:
`<project>/<experiment>/*.jsonl`, found by listing. Only real directories and regular files
are taken (a symbolic link is never followed, hidden names such as the `.spool` are passed
over), so a reader never leaves the store; several stores, one per replica, read as one when
their runs are grouped by name (`runs`). A torn last line (a crash mid-write) is no record:
only newline-terminated lines count.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from trace_proxy.store.layout import NAME_FILE
from trace_proxy.store.names import decode_name
from trace_proxy.store.replicas import store_roots

RunName = tuple[str, str]  # the names of a run's project and experiment directories


def runs(stores: Iterable[Path], *, parts: bool = False) -> dict[RunName, list[Path]]:
    """Each run of the given stores, by its directories' names, with its directory in each
    store that holds it, in the stores' order. `parts`: a store may also be given by one of
    its project or experiment directories (`trace-proxy show out/project/experiment`)."""
    found: dict[RunName, list[Path]] = {}
    for store in stores:
        for project, experiment, directory in run_directories(store, parts=parts):
            found.setdefault((project, experiment), []).append(directory)
    return found


def run_directories(root: Path, *, parts: bool = False) -> Iterator[tuple[str, str, Path]]:
    """The `<project>/<experiment>` directories of one store, in name order (`parts`: or of
    the project directory, or the experiment directory, that `root` is)."""
    if parts and jsonl_files(root):  # an experiment directory
        yield root.parent.name, root.name, root
        return
    projects = subdirectories(root)
    if parts and any(jsonl_files(root / name) for name in projects):  # a project directory
        for experiment in projects:
            yield root.name, experiment, root / experiment
        return
    for project in projects:
        for experiment in subdirectories(root / project):
            yield project, experiment, root / project / experiment


def subdirectories(path: Path) -> list[str]:
    """Names of the real directories in `path` (no symbolic links, nothing hidden: `.spool`)."""
    try:
        with os.scandir(path) as listing:
            return sorted(
                e.name for e in listing
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            )  # fmt: skip
    except OSError:
        return []


def jsonl_files(directory: Path) -> list[tuple[str, os.stat_result]]:
    """The record files of a run directory, in name order, each with its `lstat` (regular
    files only: the viewer reads on from the size it saw)."""
    found = []
    try:
        with os.scandir(directory) as listing:
            for item in listing:
                if not item.name.endswith(".jsonl") or item.name.startswith("."):
                    continue
                info = item.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    found.append((item.name, info))
    except OSError:
        return []
    return sorted(found)


def run_records(directory: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The complete records of one run directory, file by file in name order."""
    for name, _ in jsonl_files(directory):
        path = directory / name
        for _, line in file_lines(path):
            yield path, orjson.loads(line)


def file_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The complete, non-blank lines of one file of a run directory (found by `jsonl_files`),
    without their newline, each with its byte offset: where `line_at` reads it again."""
    with open_no_link(path) as handle:
        offset = 0
        for line in handle:
            if not line.endswith(b"\n"):
                return  # a torn last line: no record
            if line.strip():
                yield offset, line[:-1]
            offset += len(line)


def line_at(path: Path, offset: int, length: int) -> bytes:
    """`length` bytes of a store's file from `offset`: a line read again where it was found."""
    with open_no_link(path) as handle:
        return os.pread(handle.fileno(), length, offset)


def group_name(key: Mapping[str, Any], record_id: str) -> str:
    """The GRPO group of a stored trajectory, as readers name it: its sample index, else the
    hash of its first prompt (keyless traffic, `sample_hash`), else the trajectory alone."""
    sample = key.get("sample_index")
    if isinstance(sample, int) and not isinstance(sample, bool):
        return f"sample {sample}"
    if isinstance(key.get("sample_hash"), str):
        return f"hash {key['sample_hash']}"
    return f"trajectory {record_id}"


def iter_records(root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every complete record of the store at `root` (of each of its replicas), with its file,
    run by run and file by file in name order."""
    for store in store_roots(root):
        for _, _, directory in run_directories(store, parts=True):
            yield from run_records(directory)


def open_no_link(path: Path) -> BinaryIO:
    """`path` for reading, refusing a symbolic link put there since the store was listed."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def directory_value(directory: Path, limit: int) -> str:
    """The value a store directory is for: its name file (at most `limit` bytes of it read),
    else its decoded name, else its name as it is."""
    try:
        with open_no_link(directory / NAME_FILE) as handle:
            value = json.loads(handle.read(limit).decode("utf-8"))
        if isinstance(value, str):
            return value
    except (OSError, ValueError):
        pass
    return decode_name(directory.name) or directory.name
