"""Gives every backend the same queue, worker thread, batching, retry and accounting.

Records first pass the processors (token2text) in one thread of their own, once for all
backends; then each exporter gets its own bounded queue and its own thread, so a slow or dead
backend never slows the proxy or another backend. A record is exported, still queued, or
counted as dropped with a reason (`queue_full`, `export_failed`); nothing disappears silently.
A processor that fails leaves the record as it was and it is exported all the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from trace_proxy.exporters.base import Exporter, Processor
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.record import Record

log = logging.getLogger(__name__)


class _Lane:
    """One backend: its queue, its thread and its worker task."""

    def __init__(self, exporter: Exporter, queue_size: int) -> None:
        self.exporter = exporter
        self.queue: asyncio.Queue[Record] = asyncio.Queue(maxsize=queue_size)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"export-{exporter.name}")
        self.task: asyncio.Task[None] | None = None


class ExportPipeline:
    def __init__(
        self,
        exporters: list[Exporter],
        metrics: Metrics,
        *,
        processors: list[Processor] | None = None,
        queue_size: int = 10_000,
        batch_size: int = 64,
        max_attempts: int = 5,
        backoff: float = 0.5,
    ) -> None:
        self._metrics = metrics
        self._lanes = [_Lane(e, queue_size) for e in exporters]
        self._processors = list(processors or [])
        self._inbox: asyncio.Queue[Record] = asyncio.Queue(maxsize=queue_size)
        self._process_thread = ThreadPoolExecutor(1, thread_name_prefix="export-process")
        self._process_task: asyncio.Task[None] | None = None
        self._batch_size = batch_size
        self._max_attempts = max_attempts
        self._backoff = backoff

    @property
    def backends(self) -> list[str]:
        return [lane.exporter.name for lane in self._lanes]

    def add_processor(self, processor: Processor) -> None:
        self._processors.append(processor)

    def start(self) -> None:
        for lane in self._lanes:
            self._metrics.backend_up.labels(lane.exporter.name).set(1)
        loop = asyncio.get_running_loop()
        self._process_task = loop.create_task(self._process())
        for lane in self._lanes:
            lane.task = loop.create_task(self._work(lane))

    def submit(self, record: Record) -> None:
        """Never blocks: a full queue drops the record, counted per backend."""
        try:
            self._inbox.put_nowait(record)
        except asyncio.QueueFull:
            for lane in self._lanes:
                self._metrics.export_dropped.labels(lane.exporter.name, "queue_full").inc()
            log.warning("processing queue is full: a record was dropped")

    async def _process(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._inbox.get()]
            while len(batch) < self._batch_size and not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            try:
                for processor in self._processors:
                    try:
                        await loop.run_in_executor(self._process_thread, processor.process, batch)
                    except Exception:
                        self._metrics.processing_errors.labels(processor.name).inc()
                        log.exception("processor %s failed; exporting as is", processor.name)
                for record in batch:
                    self._fan_out(record)
            finally:
                for _ in batch:
                    self._inbox.task_done()

    def _fan_out(self, record: Record) -> None:
        for lane in self._lanes:
            name = lane.exporter.name
            try:
                lane.queue.put_nowait(record)
            except asyncio.QueueFull:
                self._metrics.export_dropped.labels(name, "queue_full").inc()
                log.warning("export queue of %s is full: a record was dropped", name)
            else:
                self._metrics.export_queue.labels(name).set(lane.queue.qsize())

    async def flush(self) -> None:
        """Wait until everything submitted so far is exported or counted as dropped."""
        await self._inbox.join()
        await asyncio.gather(*(lane.queue.join() for lane in self._lanes))

    async def close(self) -> None:
        await self.flush()
        if self._process_task is not None:
            self._process_task.cancel()
        self._process_thread.shutdown(wait=True)
        loop = asyncio.get_running_loop()
        for lane in self._lanes:
            if lane.task is not None:
                lane.task.cancel()
            try:
                await loop.run_in_executor(lane.thread, lane.exporter.close)
            except Exception:
                log.exception("closing backend %s failed", lane.exporter.name)
            lane.thread.shutdown(wait=True)

    async def _work(self, lane: _Lane) -> None:
        name = lane.exporter.name
        loop = asyncio.get_running_loop()
        while True:
            batch = [await lane.queue.get()]
            while len(batch) < self._batch_size and not lane.queue.empty():
                batch.append(lane.queue.get_nowait())
            try:
                await self._export(loop, lane, batch)
            finally:
                for _ in batch:
                    lane.queue.task_done()
                self._metrics.export_queue.labels(name).set(lane.queue.qsize())

    async def _export(
        self, loop: asyncio.AbstractEventLoop, lane: _Lane, batch: list[Record]
    ) -> None:
        name = lane.exporter.name
        for attempt in range(1, self._max_attempts + 1):
            try:
                await loop.run_in_executor(lane.thread, lane.exporter.export, batch)
            except Exception as exc:
                if attempt == self._max_attempts:
                    self._metrics.export_dropped.labels(name, "export_failed").inc(len(batch))
                    log.error("backend %s failed %d times, %d records dropped: %s",
                              name, attempt, len(batch), exc)  # fmt: skip
                    return
                self._metrics.export_retries.labels(name).inc()
                self._metrics.backend_up.labels(name).set(0)
                log.warning("backend %s failed (attempt %d): %s", name, attempt, exc)
                await asyncio.sleep(self._backoff * 2 ** (attempt - 1))
            else:
                self._metrics.exported.labels(name).inc(len(batch))
                self._metrics.backend_up.labels(name).set(1)
                self._metrics.export_lag.labels(name).set(max(0.0, time.time() - _newest(batch)))
                return


def _newest(batch: list[Record]) -> float:
    """When the newest record of a batch was complete (its end, or its time for events)."""
    times = [getattr(r, "end", None) or getattr(r, "time", None) or 0.0 for r in batch]
    return float(max(times, default=0.0))
