"""The proxy's side of exporting: never blocks, never loses a record without counting it.

A closed trajectory goes into a bounded memory queue; a writer thread appends it to the durable
spool (`spool.py`); the exporters read the spool, in this process (`ExportRunner`) or in an
export process of their own (`process.py`), so export work never competes with forwarding for
the interpreter. A record is dropped only when the memory queue is full while the spool cannot
take more (counted in `trace_proxy_spool_dropped`), or when the spool's disk budget deletes it
before a backend had it (counted per backend in `trace_proxy_export_dropped`).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from trace_proxy.exporters.spool import SpoolFull, SpoolWriter
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.record import Record, dumps

log = logging.getLogger(__name__)


class Exports(Protocol):
    """Where the spool is read and exported: this process, or the export process."""

    @property
    def backends(self) -> list[str]: ...

    async def start(self) -> None: ...

    def notify(self, end: int) -> None: ...

    async def flush(self, end: int) -> None: ...

    async def close(self, timeout: float) -> None: ...


class ExportPipeline:
    def __init__(
        self,
        exports: Exports,
        metrics: Metrics,
        spool: SpoolWriter,
        *,
        queue_size: int = 10_000,
        batch_size: int = 256,
        retry_backoff: float = 0.5,
    ) -> None:
        self.exports = exports
        self.spool = spool
        self._metrics = metrics
        self._queue: asyncio.Queue[Record] = asyncio.Queue(maxsize=queue_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spool-writer")
        self._task: asyncio.Task[None] | None = None
        self._batch_size = batch_size
        self._retry_backoff = retry_backoff
        self._dropping = False  # the latest record submitted was dropped
        metrics.spool_bytes.set_function(lambda: spool.used_bytes)

    @property
    def backends(self) -> list[str]:
        return self.exports.backends

    @property
    def spool_dir(self) -> Path:
        return self.spool.directory

    async def start(self) -> None:
        await self.exports.start()
        self.exports.notify(self.spool.next_seq)  # what an earlier run left is exported first
        self._task = asyncio.get_running_loop().create_task(self._write())

    def submit(self, record: Record) -> None:
        """Never blocks: when memory is full too, the record is dropped and counted."""
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self._metrics.spool_dropped.labels("queue_full").inc()
            if not self._dropping:  # once a spell, not once a record
                log.warning("the spool is not keeping up and memory is full: records are "
                            "dropped until it catches up (counted in spool_dropped)")  # fmt: skip
            self._dropping = True
        else:
            self._dropping = False

    async def flush(self) -> None:
        """Wait until everything submitted so far is exported by every backend, or counted."""
        await self._queue.join()
        await self.exports.flush(self.spool.next_seq)

    async def close(self, timeout: float = 30.0) -> None:
        """Spool what is queued, give the backends `timeout` to catch up, then stop. Records a
        backend has not exported by then stay in the spool and go out on the next start."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except TimeoutError:
            left = self._queue.qsize()
            self._metrics.spool_dropped.labels("spool_error").inc(left)
            log.error("the spool could not take %d records before shutdown: dropped", left)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._thread, self.spool.close)
        self._thread.shutdown(wait=True)
        await self.exports.close(timeout)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                end = await self._append(loop, batch)
                if end is not None:
                    self.exports.notify(end)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _append(self, loop: asyncio.AbstractEventLoop, batch: list[Record]) -> int | None:
        """Spool a batch, retrying while the disk refuses it (the queue keeps filling, then
        drops). None when the batch could not be written at all."""
        delay = self._retry_backoff
        while True:
            try:
                return await loop.run_in_executor(
                    self._thread, _encode_and_append, self.spool, batch
                )
            except SpoolFull as exc:
                self._metrics.spool_dropped.labels("spool_full").inc(len(batch))
                log.error("%d records dropped: %s", len(batch), exc)
                return None
            except OSError as exc:
                if self._queue.full():
                    self._metrics.spool_dropped.labels("spool_error").inc(len(batch))
                    log.error("the spool cannot be written and memory is full: %d records "
                              "dropped: %s", len(batch), exc)  # fmt: skip
                    return None
                log.warning("the spool cannot be written (again in %.1f s): %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)


def _encode_and_append(spool: SpoolWriter, batch: list[Record]) -> int:
    return spool.append([dumps(record) for record in batch])
