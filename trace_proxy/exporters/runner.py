"""Exports the spool to every backend: the OpenTelemetry Collector's exporterhelper, for us.

Each backend has a lane: its own thread, its own reader of the spool and its own cursor, so a
slow or dead backend only falls behind on disk and never holds up another. A lane reads a
batch, has the processors (token2text) enrich it — once for all lanes that read the same
records, through a small shared cache — exports it, and moves its cursor past it.

A backend that writes spool lines as they are (jsonl: `Capabilities.writes_spooled_lines`) gets
trajectories with only their head decoded while no processor would change them (each says so:
`Processor.inactive`; token2text without a tokenizer, or none configured): decoding a whole
trajectory and encoding it again cost more than writing it. What a backend can do is read from
its declared `capabilities` (`base.py`), never probed.

Failures: a backend that raises is retried with exponential backoff (capped), for as long as it
takes; its records wait in the spool, within the spool's disk budget. A record a backend
rejects for good (`ExportRejected`, or a conversion bug: TypeError, ValueError, KeyError,
AttributeError) is dropped and counted (`rejected`), after its batch was retried record by
record so the others still go out. Before a batch is exported its range is written to the
cursor as pending; after a crash, a backend that can tell (`tells_exported`) skips the records
of that range it already has, so a replay does not duplicate them.

One runner exports a spool directory at a time: `start` takes its export lock, waiting a bounded
time for a leftover (the export process of a proxy that was killed, finishing), and only then
reads the cursors. Its threads may run at a lower CPU priority than the process
(`thread_initializer`); `hurry` moves the lanes to threads at the process's own, for shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trace_proxy.exporters.base import Exporter, ExportRejected, Processor
from trace_proxy.exporters.spool import (
    Cursor,
    CursorState,
    SpoolLock,
    SpoolReader,
    acquire,
    release,
)
from trace_proxy.metrics import ExportMetrics
from trace_proxy.trajectories.record import (
    Record,
    SpooledTrajectory,
    Trajectory,
    loads,
    spooled_trajectory,
)

log = logging.getLogger(__name__)

PERMANENT = (ExportRejected, TypeError, ValueError, KeyError, AttributeError)
LINGER = 0.1  # seconds an idle lane waits once woken, so records go out in batches
Numbered = list[tuple[int, Record | SpooledTrajectory]]


class _Lane:
    """One backend: its thread, reader, cursor and position."""

    def __init__(
        self,
        exporter: Exporter,
        directory: Path,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.exporter = exporter
        self.name = exporter.name
        self.capabilities = exporter.capabilities
        self.spooled_lines = self.capabilities.writes_spooled_lines
        self.export: Callable[[list[Any]], None] = (
            exporter.export_lines if self.spooled_lines else exporter.export
        )
        self.thread = self.new_thread(initializer)
        self.reader = SpoolReader(directory)
        self.cursor = Cursor(directory, exporter.name)
        self.next = 0
        self.replay_until: int | None = None  # a crash may have left these exported already
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.released_at: int | None = None  # the segment the last release() was made from

    def new_thread(self, initializer: Callable[[], None] | None) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            1, thread_name_prefix=f"export-{self.name}", initializer=initializer
        )

    def load(self) -> None:
        """Where the backend is (read once the export lock is held)."""
        state = self.cursor.load()
        self.next = state.next
        self.replay_until = state.pending


class _Processed:
    """Records read and enriched once, shared by lanes reading the same part of the spool."""

    def __init__(self, processors: list[Processor], metrics: ExportMetrics, size: int) -> None:
        self.processors = processors
        self._metrics = metrics
        self._size = size
        self._records: OrderedDict[int, Record] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, batch: list[tuple[int, bytes]]) -> tuple[Numbered, int]:
        """The batch as records (processed), and how many lines were not records."""
        with self._lock:
            fresh: list[tuple[int, Record]] = []
            bad = 0
            for seq, payload in batch:
                if seq in self._records:
                    continue
                try:
                    fresh.append((seq, loads(payload)))
                except ValueError:
                    bad += 1
            self._process([record for _, record in fresh])
            for seq, record in fresh:
                self._records[seq] = record
            found: Numbered = [
                (seq, self._records[seq]) for seq, _ in batch if seq in self._records
            ]
            while len(self._records) > self._size:
                self._records.popitem(last=False)
            return found, bad

    @property
    def inactive(self) -> bool:
        """No processor would change a record now (each says so: `inactive`)."""
        return all(p.inactive for p in self.processors)

    def heads(self, batch: list[tuple[int, bytes]]) -> tuple[Numbered, int]:
        """The batch for a backend that writes spooled lines, while `inactive`: trajectories
        with their head decoded, other records (small) in full; how many were not records."""
        found: Numbered = []
        bad = trajectories = 0
        for seq, payload in batch:
            head = spooled_trajectory(payload)
            if head is not None:
                found.append((seq, head))
                trajectories += 1
                continue
            try:
                found.append((seq, loads(payload)))
            except ValueError:
                bad += 1
        if trajectories:
            for processor in self.processors:  # what they would have counted as skipped
                processor.passed_over(trajectories)
        return found, bad

    def _process(self, records: list[Record]) -> None:
        if not records:
            return
        for processor in self.processors:
            try:
                processor.process(records)
            except Exception:
                self._metrics.processing_errors.labels(processor.name).inc()
                log.exception("processor %s failed; exporting as is", processor.name)


class ExportRunner:
    def __init__(
        self,
        directory: Path,
        exporters: list[Exporter],
        metrics: ExportMetrics,
        *,
        processors: list[Processor] | None = None,
        batch_size: int = 64,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        linger: float = LINGER,
        thread_initializer: Callable[[], None] | None = None,
        lock_wait: float = 0.0,
        proxy: int | None = None,
    ) -> None:
        """`lock_wait`: how long `start` waits for a leftover holding the export lock;
        `proxy`: the pid of the proxy this runner belongs to (a lock held for another, running
        proxy is an error at once)."""
        self.directory = Path(directory)
        self._metrics = metrics
        self._lanes = [_Lane(e, self.directory, thread_initializer) for e in exporters]
        self._lowered = thread_initializer is not None
        self.lock = SpoolLock(self.directory, "export", proxy)
        self._lock_wait = lock_wait
        self.started = False
        self.hurried = False
        self._batch_size = batch_size
        self._processed = _Processed(
            list(processors or []), metrics, size=4 * batch_size * max(1, len(self._lanes))
        )
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._end = 0  # the spool's end, as last notified
        self._progress = asyncio.Condition()
        self._closing = asyncio.Event()
        self._linger = linger
        self._hurry = asyncio.Event()  # set while someone waits in flush(): no lingering
        self._flushes = 0
        # Called before a cursor moves past exported records: whoever relays the counters
        # sends them now, so a crash right after the move cannot lose what was counted.
        self.before_commit: Callable[[], None] | None = None

    @property
    def backends(self) -> list[str]:
        return [lane.name for lane in self._lanes]

    def add_processor(self, processor: Processor) -> None:
        self._processed.processors.append(processor)

    async def start(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the export lock (SpoolBusy when another proxy holds it), then export from
        every backend's cursor on."""
        self.directory.mkdir(parents=True, exist_ok=True)
        await acquire(self.lock, self._lock_wait, on_wait)
        loop = asyncio.get_running_loop()
        for lane in self._lanes:
            lane.load()
            self._metrics.backend_up.labels(lane.name).set(1)
            lane.task = loop.create_task(self._run(lane))
        self.started = True

    def hurry(self, initializer: Callable[[], None] | None = None) -> None:
        """From the next export on, each lane runs on a thread at the process's own priority
        (shutdown: the spool should drain within the grace, even on busy cores); the new
        threads run `initializer` first."""
        if self.hurried or not self._lowered:
            return
        self.hurried = True
        for lane in self._lanes:
            old, lane.thread = lane.thread, lane.new_thread(initializer)
            old.shutdown(wait=False)  # its export under way finishes there

    def notify(self, end: int) -> None:
        """New records were spooled up to (not including) `end`."""
        self._end = max(self._end, end)
        for lane in self._lanes:
            lane.wake.set()

    async def flush(self, end: int | None = None) -> None:
        """Wait until every backend has exported (or counted) every record before `end`."""
        target = self._end if end is None else end
        self._flushes += 1
        self._hurry.set()
        try:
            self.notify(target)
            async with self._progress:
                await self._progress.wait_for(lambda: all(ln.next >= target for ln in self._lanes))
        finally:
            self._flushes -= 1
            if not self._flushes:
                self._hurry.clear()

    async def close(self, timeout: float) -> None:
        """Export what is spooled within `timeout`; what is left stays in the spool for the next
        start. Then close every backend (each within what is left of `timeout`, or a second)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.started:
            try:
                await asyncio.wait_for(self.flush(), timeout)
            except asyncio.TimeoutError:
                behind = {ln.name: self._end - ln.next for ln in self._lanes
                          if ln.next < self._end}  # fmt: skip
                log.warning("records left in the spool for the next start: %s", behind)
        self._closing.set()
        for lane in self._lanes:
            if lane.task is not None:
                lane.task.cancel()
                await asyncio.wait([lane.task], timeout=max(deadline - loop.time(), 1.0))
            try:  # waits for an export still running in the thread, up to a limit
                await asyncio.wait_for(
                    loop.run_in_executor(lane.thread, lane.exporter.close),
                    max(deadline - loop.time(), 1.0),
                )
            except asyncio.TimeoutError:
                log.error("backend %s did not close in time", lane.name)
            except Exception:
                log.exception("closing backend %s failed", lane.name)
            lane.reader.close()
            lane.thread.shutdown(wait=False)
        self.lock.release()

    # --- one lane ---

    async def _run(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing.is_set():
            lane.wake.clear()  # before reading: a record spooled meanwhile wakes us again
            batch = await loop.run_in_executor(
                lane.thread, lane.reader.read, lane.next, self._batch_size
            )
            if batch.next == lane.next:
                # Look again after a while anyway: the spool is the truth, notices are hints.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lane.wake.wait(), 1.0)
                if lane.wake.is_set() and not self._hurry.is_set():
                    # Woken from idle: let a batch gather (each batch costs cursor writes).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._hurry.wait(), self._linger)
                continue
            dropped = self._metrics.export_dropped
            if batch.missing:
                dropped.labels(lane.name, "spool_full").inc(batch.missing)
            if batch.corrupt:
                dropped.labels(lane.name, "spool_corrupt").inc(batch.corrupt)
            processed = self._processed
            as_lines = lane.spooled_lines and lane.replay_until is None and processed.inactive
            read = processed.heads if as_lines else processed.get
            records, bad = await loop.run_in_executor(lane.thread, read, batch.records)
            if bad:
                dropped.labels(lane.name, "spool_corrupt").inc(bad)
            if records:
                await self._deliver(lane, records, batch.next)
            await self._advance(lane, batch.next)
            if len(batch.records) < self._batch_size and not self._hurry.is_set():
                # Caught up: let the next batch gather as well. Each batch costs two cursor
                # writes and five hops to the lane's thread whatever its size; at a rollout's
                # pace, batches of a few trajectories each followed each other back to back.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), self._linger)

    async def _deliver(self, lane: _Lane, records: Numbered, end: int) -> None:
        loop = asyncio.get_running_loop()
        if lane.replay_until is not None and records[0][0] < lane.replay_until:
            before = len(records)
            records = await loop.run_in_executor(lane.thread, _not_yet_exported, lane, records)
            # Exported by a process that died before its cursor moved (and maybe before it
            # reported them): counted here, so a crash never makes the counter fall short.
            self._metrics.exported.labels(lane.name).inc(before - len(records))
        lane.replay_until = None
        if not records:
            return
        await loop.run_in_executor(lane.thread, lane.cursor.save, CursorState(lane.next, end))
        await self._export(lane, [record for _, record in records])

    async def _advance(self, lane: _Lane, end: int) -> None:
        loop = asyncio.get_running_loop()
        lane.next = end
        if self.before_commit is not None:
            self.before_commit()
        await loop.run_in_executor(lane.thread, self._commit, lane)
        async with self._progress:
            self._progress.notify_all()

    def _commit(self, lane: _Lane) -> None:
        lane.cursor.save(CursorState(lane.next))
        segment = lane.reader.segment
        if segment != lane.released_at:  # only a lane leaving a segment can free one
            release(self.directory, self.backends)
            lane.released_at = segment

    async def _export(self, lane: _Lane, records: list[Record | SpooledTrajectory]) -> None:
        loop = asyncio.get_running_loop()
        name = lane.name
        attempt = 0
        while True:
            try:
                await loop.run_in_executor(lane.thread, lane.export, records)
            except PERMANENT as exc:
                if len(records) > 1:  # find the records at fault; the others go out
                    for record in records:
                        await self._export(lane, [record])
                    return
                self._metrics.export_dropped.labels(name, "rejected").inc()
                log.error("backend %s rejected a record for good, dropped: %r", name, exc)
                return
            except Exception as exc:
                attempt += 1
                self._metrics.export_retries.labels(name).inc()
                self._metrics.backend_up.labels(name).set(0)
                delay = min(self._max_backoff, self._backoff * 2 ** (attempt - 1))
                log.warning("backend %s failed (attempt %d, again in %.1f s): %s",
                            name, attempt, delay, exc)  # fmt: skip
                await asyncio.sleep(delay)
            else:
                self._metrics.exported.labels(name).inc(len(records))
                self._metrics.backend_up.labels(name).set(1)
                self._metrics.export_lag.labels(name).set(max(0.0, time.time() - _newest(records)))
                return


def _not_yet_exported(lane: _Lane, records: Numbered) -> Numbered:
    """After a crash: drop the records of the pending range that the backend already has."""
    until = lane.replay_until or 0
    pending = [r for seq, r in records if seq < until and isinstance(r, Trajectory)]
    if not lane.capabilities.tells_exported or not pending:
        return records
    try:
        present = lane.exporter.exported_ids(pending)
    except Exception:
        log.exception("backend %s cannot tell what it already has; replaying", lane.name)
        return records
    return [
        (seq, r)
        for seq, r in records
        if not (seq < until and isinstance(r, Trajectory) and r.id in present)
    ]


def _newest(batch: list[Record | SpooledTrajectory]) -> float:
    """When the newest record of a batch was complete (its end, or its time for events)."""
    times = [getattr(r, "end", None) or getattr(r, "time", None) or 0.0 for r in batch]
    return float(max(times, default=0.0))
