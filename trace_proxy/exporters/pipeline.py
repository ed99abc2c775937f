"""The proxy's side of exporting: never blocks, never loses a record without counting it.

A closed trajectory goes into a bounded memory queue; a writer thread appends it to the durable
spool (`spool.py`); the exporters read the spool, in this process (`ExportRunner`) or in an
export process of their own (`processes/export.py`), so export work never competes with
forwarding for the interpreter. A record is dropped only when the memory queue is full while
the spool cannot take more (counted in `trace_proxy_spool_dropped`), when it cannot be written
as JSON at all (a bug; counted there as `unencodable`, so it never stops the writer and the
records after it), or when the spool's disk budget deletes it before a backend had it (counted
per backend in `trace_proxy_export_dropped`).

Neither the spool nor the exporters are waited for at start: records queue in memory while the
spool's lock is awaited (a leftover of a killed proxy may still hold it), and wait in the spool
while the exporters start. `spool_check` says which, for /ready. At close, how many records each
backend still has in the spool is logged (and kept in `backlog`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from trace_proxy.exporters.spool import SpoolBusy, SpoolFull, SpoolWriter, acquire, backlog
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.ledger import Ledger
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

    def hurry(self) -> None: ...


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
        lock_wait: float = 0.0,
        ledger: Ledger | None = None,
    ) -> None:
        """`spool` may still have to take its lock (`SpoolWriter(locked=False)`): the writer
        waits for it up to `lock_wait` seconds when a leftover holds it."""
        self.exports = exports
        self.spool = spool
        self._metrics = metrics
        self._queue: asyncio.Queue[Record] = asyncio.Queue(maxsize=queue_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spool-writer")
        self._task: asyncio.Task[None] | None = None
        self._batch_size = batch_size
        self._retry_backoff = retry_backoff
        self._dropping = False  # the latest record submitted was dropped
        self._lock_wait = lock_wait
        self._opened: asyncio.Future[None] | None = None  # made in start_writing()
        self.spool_check = "ok" if spool.opened else "not opened yet"
        self.backlog: dict[str, int] | None = None  # per backend, once closed
        self.on_change: Callable[[], None] | None = None
        self.on_failure: Callable[[BaseException], None] | None = None  # the spool is not ours
        self.ledger = ledger if ledger is not None else Ledger()
        # Told (first sequence number, units of each record) right before a batch is written.
        self.before_write: Callable[[int, list[int]], None] | None = None
        self.opened_at: int | None = None  # where the spool ended when it was opened
        metrics.spool_bytes.set_function(lambda: spool.used_bytes)
        for name in self.backends:
            metrics.export_queue.labels(name).set_function(functools.partial(self._behind, name))

    @property
    def backends(self) -> list[str]:
        return self.exports.backends

    @property
    def spool_dir(self) -> Path:
        return self.spool.directory

    async def start(self) -> None:
        self.start_writing()
        await self.exports.start()

    def start_writing(self) -> None:
        """Take records from now on; they are spooled once the spool is ours."""
        loop = asyncio.get_running_loop()
        self._opened = loop.create_future()
        self._task = loop.create_task(self._write())

    def hurry(self) -> None:
        """Shutdown has begun: the exporters may use more CPU to drain the spool in time."""
        self.exports.hurry()

    def submit(self, record: Record) -> None:
        """Never blocks: when memory is full too, the record is dropped and counted."""
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.ledger.settle_record(record)
            self._metrics.spool_dropped.labels("queue_full").inc()
            if not self._dropping:  # once a spell, not once a record
                log.warning("the spool is not keeping up and memory is full: records are "
                            "dropped until it catches up (counted in spool_dropped)")  # fmt: skip
            self._dropping = True
        else:
            self._dropping = False

    async def flush(self) -> None:
        """Wait until everything submitted so far is exported by every backend, or counted."""
        assert self._opened is not None, "start() first"
        await asyncio.shield(self._opened)  # raises when the spool could not be had
        await self._queue.join()
        await self.exports.flush(self.spool.next_seq)

    async def close(self, timeout: float = 30.0) -> None:
        """Spool what is queued (given at least a second), give the backends what is left of
        `timeout` to catch up, then stop. Records a backend has not exported by then stay in
        the spool and go out on the next start; how many is logged."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            await asyncio.wait_for(self._queue.join(), max(timeout, 1.0))
        except asyncio.TimeoutError:
            left = self._queue.qsize()
            self._metrics.spool_dropped.labels("spool_error").inc(left)
            log.error("the spool could not take %d records before shutdown: dropped", left)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        opened = self.spool.opened
        await loop.run_in_executor(self._thread, self.spool.close)
        self._thread.shutdown(wait=True)
        await self.exports.close(max(deadline - loop.time(), 0.0))
        if opened:
            self.backlog = backlog(self.spool_dir, self.backends, self.spool.next_seq)
            counts = ", ".join(f"{name} {count}" for name, count in self.backlog.items())
            if any(self.backlog.values()):
                log.warning("records each backend still has in the spool (exported on the next "
                            "start): %s", counts)  # fmt: skip
            else:
                log.info("records each backend still has in the spool: %s", counts)

    def _behind(self, backend: str) -> int:
        if not self.spool.opened:
            return 0
        return backlog(self.spool_dir, [backend], self.spool.next_seq)[backend]

    def _set_spool(self, check: str) -> None:
        if check != self.spool_check:
            self.spool_check = check
            if self.on_change is not None:
                self.on_change()

    async def _open(self) -> bool:
        """Take the spool's lock (waiting for a leftover), then find where it ends."""
        assert self._opened is not None
        if not self.spool.opened:
            self._set_spool("waiting for its lock")
            try:
                await acquire(self.spool.lock, self._lock_wait, self._set_spool)
                self.spool.open()
            except (SpoolBusy, OSError) as exc:
                self._set_spool(f"failed: {exc}")
                self._opened.set_exception(exc)
                self._opened.exception()  # retrieved: `on_failure` is told
                if self.on_failure is not None:
                    self.on_failure(exc)
                return False
        self._set_spool("ok")
        self.opened_at = self.spool.next_seq
        self.exports.notify(self.spool.next_seq)  # what an earlier run left is exported first
        self._opened.set_result(None)
        return True

    async def _write(self) -> None:
        if not await self._open():
            return  # the memory queue fills, then drops and counts; the proxy ends on it
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
        lines, encoded, failed = await loop.run_in_executor(self._thread, _encode, batch)
        if failed:
            self._metrics.spool_dropped.labels("unencodable").inc(len(failed))
            for record in failed:
                self.ledger.settle_record(record)
        units = self.ledger.take(encoded)
        if self.before_write is not None:
            self.before_write(self.spool.next_seq, units)
        delay = self._retry_backoff
        while True:
            try:
                end = await loop.run_in_executor(self._thread, self.spool.append, lines)
            except SpoolFull as exc:
                self._dropped("spool_full", lines, units)
                log.error("%d records dropped: %s", len(lines), exc)
                return None
            except OSError as exc:
                self._set_spool(f"cannot be written: {exc}")
                if self._queue.full():
                    self._dropped("spool_error", lines, units)
                    log.error("the spool cannot be written and memory is full: %d records "
                              "dropped: %s", len(lines), exc)  # fmt: skip
                    return None
                log.warning("the spool cannot be written (again in %.1f s): %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
            else:
                self._set_spool("ok")
                return end

    def _dropped(self, reason: str, lines: list[bytes], units: list[int]) -> None:
        self._metrics.spool_dropped.labels(reason).inc(len(lines))
        self.ledger.settle(sum(units))


def _encode(batch: list[Record]) -> tuple[list[bytes], list[Record], list[Record]]:
    """The lines of the records that can be written as JSON, those records, and the others
    (a bug: dropped and counted, never stopping the writer)."""
    lines: list[bytes] = []
    encoded: list[Record] = []
    failed: list[Record] = []
    for record in batch:
        try:
            lines.append(dumps(record))
        except (TypeError, ValueError):
            log.exception("a %s record cannot be written as JSON: dropped", record.record)
            failed.append(record)
        else:
            encoded.append(record)
    return lines, encoded, failed
