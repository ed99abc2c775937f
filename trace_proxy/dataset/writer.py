"""Rows into a directory of Parquet files, written by pyarrow a bounded batch at a time.

A batch becomes a row group once it holds `batch_rows` rows or about `batch_values` list items
and characters (a 32k-token prompt per RL row adds up fast), and a file is closed after
`rows_per_file` rows, so memory stays bounded whatever the export's size. Each file is written
under a hidden name and renamed when complete, so `datasets` never reads half a file. File
names are the writer's own (`part-00000.parquet`, ...), never anything from a record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trace_proxy.dataset.reading import SelectionError


def prepare_directory(directory: Path, force: bool) -> None:
    """`directory` made ready for an export: created, or empty, or (`force`) its Parquet files
    removed. Anything else in it stays; a non-empty one without `force` is refused."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise SelectionError(f"--out {directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in directory.iterdir())
    if present and not force:
        raise SelectionError(
            f"--out {directory} is not empty ({', '.join(present[:3])}"
            f"{', ...' if len(present) > 3 else ''}); --force replaces the Parquet files in it"
        )
    for name in present:
        path = directory / name
        if name.endswith(".parquet") and (path.is_symlink() or path.is_file()):
            path.unlink()


class ParquetParts:
    """Rows appended in order, written as row groups of `part-NNNNN.parquet` files."""

    def __init__(
        self,
        directory: Path,
        schema: pa.Schema,
        *,
        rows_per_file: int = 100_000,
        batch_rows: int = 1024,
        batch_values: int = 8_000_000,
    ) -> None:
        self.directory = directory
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.batch_rows = batch_rows
        self.batch_values = batch_values
        self.files: list[Path] = []
        self.rows = 0
        self._batch: list[dict[str, Any]] = []
        self._values = 0
        self._writer: pq.ParquetWriter | None = None
        self._partial: Path | None = None
        self._in_file = 0

    def add(self, row: dict[str, Any]) -> None:
        self._batch.append(row)
        self._values += _size(row)
        room = min(self.batch_rows, self.rows_per_file - self._in_file)
        if len(self._batch) >= room or self._values >= self.batch_values:
            self._flush()

    def close(self) -> list[Path]:
        """Write what is left; a file with no rows (and the schema) when nothing was added."""
        if self._batch or (not self.files and self._writer is None):
            self._flush()
        self._finish_file()
        return self.files

    def abandon(self) -> None:
        """Remove the file being written (an export that failed or was interrupted)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None

    def _flush(self) -> None:
        if self._writer is None:
            name = f"part-{len(self.files):05d}.parquet"
            self._partial = self.directory / f".{name}.partial"
            self._writer = pq.ParquetWriter(self._partial, self.schema, compression="zstd")
        table = pa.Table.from_pylist(self._batch, schema=self.schema)
        self._writer.write_table(table)
        self.rows += len(self._batch)
        self._in_file += len(self._batch)
        self._batch, self._values = [], 0
        if self._in_file >= self.rows_per_file:
            self._finish_file()

    def _finish_file(self) -> None:
        if self._writer is None or self._partial is None:
            return
        self._writer.close()
        final = self.directory / self._partial.name[1 : -len(".partial")]
        os.replace(self._partial, final)
        self.files.append(final)
        self._writer, self._partial, self._in_file = None, None, 0


def _size(row: dict[str, Any]) -> int:
    """About how much a row holds: its lists' items and its strings' characters, plus one."""
    return 1 + sum(len(v) for v in row.values() if isinstance(v, (list, str)))
