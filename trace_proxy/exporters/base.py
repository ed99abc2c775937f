"""What a backend implements: convert records and push a batch, and say what else it can do.

The spool, batching, retry, threading and accounting come from `pipeline.ExportPipeline` and
`runner.ExportRunner`, which wrap every exporter the same way (the OpenTelemetry Collector's
exporterhelper pattern). What a backend or a processor can do beyond that is declared here,
with its default, and read by the runner as declared (the Collector's `WithCapabilities`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from trace_proxy.trajectories.record import Record, SpooledTrajectory, Trajectory, loads


class Processor(Protocol):
    """Enriches records once, before they fan out to the backends (e.g. token2text)."""

    name: str

    def process(self, records: list[Record]) -> None:
        """Mutate the records in place; blocking is fine (runs in its own thread)."""

    @property
    def inactive(self) -> bool:
        """True while it would change no record: while every processor is, a backend that
        writes spool lines as they are gets them undecoded. Default: never."""
        return False

    def passed_over(self, trajectories: int) -> None:
        """Told how many trajectories went by unprocessed while it was inactive. Default:
        nothing to count."""
        return None


class ExportRejected(Exception):
    """The backend refused these records for good: retrying would not help (they are dropped
    and counted as `rejected`)."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond `export` and `close`; the defaults are a backend that can
    do neither, which is exported to record by record and sent a crash's batch again."""

    writes_spooled_lines: bool = False
    """It writes a record's spool line as it is: `export_lines` takes `SpooledTrajectory` items
    (a spool line, head decoded) beside records, while no processor would change them."""

    tells_exported: bool = False
    """It can tell which records it already holds (`exported_ids`): asked after a crash about
    the batch that was in flight, so that a replay does not duplicate them."""


class Exporter(Protocol):
    """A backend. Each one subclasses this and declares its `capabilities`."""

    name: str
    capabilities: Capabilities = Capabilities()

    def export(self, records: list[Record]) -> None:
        """Push a batch; blocking is fine (runs in a worker thread); raise to request a retry
        (any exception), or ExportRejected when the records can never be accepted."""

    def export_lines(self, items: Sequence[Record | SpooledTrajectory]) -> None:
        """Push a batch of which some trajectories are still spool lines (asked only of a
        backend that `writes_spooled_lines`). Default: each line decoded, then `export`."""
        self.export([loads(i.line) if isinstance(i, SpooledTrajectory) else i for i in items])

    def exported_ids(self, records: list[Trajectory]) -> set[str]:
        """The ids of those of `records` it already holds (asked only of a backend that
        `tells_exported`). Default: none it can tell of, so all are exported again."""
        return set()

    def close(self) -> None:
        """Make everything exported so far durable; called once, after the last export."""
