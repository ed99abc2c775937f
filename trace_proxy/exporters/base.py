"""What a backend implements: convert records and push a batch; nothing else.

Queueing, batching, retry, threading and accounting come from `pipeline.ExportPipeline`, which
wraps every exporter the same way (the OpenTelemetry Collector's exporterhelper pattern).
"""

from __future__ import annotations

from typing import Protocol

from trace_proxy.trajectories.record import Record


class Processor(Protocol):
    """Enriches records once, before they fan out to the backends (e.g. token2text)."""

    name: str

    def process(self, records: list[Record]) -> None:
        """Mutate the records in place; blocking is fine (runs in its own thread)."""


class Exporter(Protocol):
    name: str

    def export(self, records: list[Record]) -> None:
        """Push a batch; blocking is fine (runs in a worker thread); raise to request a retry."""

    def close(self) -> None:
        """Make everything exported so far durable; called once, after the last export."""
