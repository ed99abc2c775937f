"""What a backend implements: convert records and push a batch; nothing else.

The spool, batching, retry, threading and accounting come from `pipeline.ExportPipeline` and
`runner.ExportRunner`, which wrap every exporter the same way (the OpenTelemetry Collector's
exporterhelper pattern).
"""

from __future__ import annotations

from typing import Protocol

from trace_proxy.trajectories.record import Record


class Processor(Protocol):
    """Enriches records once, before they fan out to the backends (e.g. token2text).

    It may also define `inactive` (a property: True while it would change no record) and
    `passed_over(trajectories: int)` (told how many went by unprocessed meanwhile); while every
    processor is inactive, a backend that writes spool lines as they are gets them undecoded.
    """

    name: str

    def process(self, records: list[Record]) -> None:
        """Mutate the records in place; blocking is fine (runs in its own thread)."""


class ExportRejected(Exception):
    """The backend refused these records for good: retrying would not help (they are dropped
    and counted as `rejected`)."""


class Exporter(Protocol):
    """A backend. It may also define `exported_ids(records: list[Trajectory]) -> set[str]`: the
    ids of those it already holds, asked after a crash about the batch that was in flight; and
    `writes_spooled_lines = True` with `export_lines(items)`, taking `SpooledTrajectory` items
    (a spool line, head decoded) beside records, when it writes a record's line as it is."""

    name: str

    def export(self, records: list[Record]) -> None:
        """Push a batch; blocking is fine (runs in a worker thread); raise to request a retry
        (any exception), or ExportRejected when the records can never be accepted."""

    def close(self) -> None:
        """Make everything exported so far durable; called once, after the last export."""
