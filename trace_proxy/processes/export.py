"""The export process: exporters and token2text run beside the proxy, not inside it.

Backend SDKs (MLflow, Weave, trackio, OpenTelemetry) and token decoding are CPU work in Python;
in the proxy's process they would hold the interpreter lock against forwarding. Here they run
in a child process that reads the spool on its own; the proxy only tells it, over a socket
pair, how far the spool goes, and asks it to flush and stop. The child sends back its metrics
(the text format, relayed on the proxy's /metrics) and answers flushes. If it dies, the proxy
starts another, which resumes from the backends' cursors: nothing spooled is lost.

Priority: the threads that do the work (SDK imports, tokenizer loading, decoding, exporting)
run under SCHED_IDLE (`--export-priority`), so that on a busy machine exporting lags rather
than forwarding; its event loop keeps the proxy's priority. Once shutdown begins (`hurry`), the
lanes move to threads at the proxy's priority, so the spool drains within the grace on busy
cores too. Raising a thread's priority back needs privileges; starting a new thread at the
process's own priority does not.

Start-up (importing SDKs, loading tokenizers: seconds, minutes on busy cores) is not waited
for: records wait in the spool, and /ready says the export process is starting. An export
process asked to stop before it is ready is sent SIGTERM: it holds nothing.

Messages are JSON lines: to the child `data` (the spool's end), `flush`, `hurry`, `stop`; from
it `starting` (what it waits for), `ready` or `error` (at start), `discovered` (token2text found
the served tokenizers), `metrics`, `flushed`, `stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import generate_latest

from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import SpoolBusy
from trace_proxy.metrics import ExportMetrics, Metrics, RelayedMetrics
from trace_proxy.processes.helper import (
    PER_THREAD_PRIORITY,
    Helper,
    Started,
    lower_thread,
    name_thread,
    proxy_pid,
    receive_payload,
    run_helper,
)
from trace_proxy.processes.lifeline import Lifeline, leftover_wait
from trace_proxy.processes.text_path import add_token2text, discover_served, needs_discovery
from trace_proxy.text.token2text import Token2Text, TokenizerError

log = logging.getLogger(__name__)

METRICS_EVERY = 1.0
RESTART_DELAY = 1.0


def export_runner(
    settings: Settings,
    spool_dir: Path,
    metrics: ExportMetrics,
    exporters: list[Exporter],
    thread_initializer: Callable[[], None] | None = None,
) -> ExportRunner:
    """The runner for these settings, in this process or the export process (token2text is
    added by `text_path.add_token2text`)."""
    return ExportRunner(
        spool_dir,
        exporters,
        metrics,
        thread_initializer=thread_initializer,
        lock_wait=leftover_wait(settings.shutdown_grace),
        proxy=proxy_pid(),
    )


# --- the proxy's side ----------------------------------------------------------------------


class ExportProcess(Helper):
    """Starts, feeds, supervises and stops the export process; when it dies, another resumes
    from the backends' cursors."""

    name = "export process"
    restart_delay = RESTART_DELAY
    terminate_while_starting = True

    def __init__(self, settings: Settings, spool_dir: Path, metrics: Metrics) -> None:
        super().__init__(__name__, (settings, spool_dir))
        self.settings = settings
        self.spool_dir = spool_dir
        self._metrics = metrics
        self._relayed = RelayedMetrics()
        metrics.registry.register(self._relayed)
        self._backends = list(dict.fromkeys(settings.backend))
        self._end = 0
        self._ids = itertools.count()
        self._flushes: dict[int, tuple[int, asyncio.Future[None]]] = {}

    @property
    def backends(self) -> list[str]:
        return self._backends

    def notify(self, end: int) -> None:
        if end > self._end:
            self._end = end
            self._send({"op": "data", "end": end})

    async def flush(self, end: int) -> None:
        self.notify(end)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        flush_id = next(self._ids)
        self._flushes[flush_id] = (end, future)
        self._send({"op": "flush", "id": flush_id, "end": end})
        await future

    def hurry(self) -> None:
        self._send({"op": "hurry"})

    async def close(self, timeout: float) -> None:
        """Export what is spooled within `timeout`, then stop. A child still starting is
        given that time to be ready first (else it is ended: what it would export stays in
        the spool)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError, ConfigError, TokenizerError):
            await asyncio.wait_for(self.wait_ready(), timeout)
        left = max(deadline - loop.time(), 0.0)
        await self._stop(orjson.dumps({"op": "stop", "timeout": left}) + b"\n", left + 30)
        self._fail_flushes("the export process has stopped")

    def _fail(self, error: BaseException) -> None:
        super()._fail(error)
        self._fail_flushes(f"the export process cannot start: {error}")

    def _fail_flushes(self, why: str) -> None:
        for _, future in self._flushes.values():  # nobody is left to answer them
            if not future.done():
                future.set_exception(RuntimeError(why))
        self._flushes.clear()

    def _started(self) -> None:
        self._send({"op": "data", "end": self._end})
        for flush_id, (end, _) in self._flushes.items():  # asked of a child that died
            self._send({"op": "flush", "id": flush_id, "end": end})

    def _died(self) -> None:
        self._metrics.export_process_restarts.inc()
        self._relayed.retire()

    def _on_message(self, op: str, message: dict[str, Any]) -> None:
        if op == "metrics":
            self._relayed.text = message["text"]
        elif op == "flushed":
            _, future = self._flushes.pop(message["id"], (0, None))
            if future is not None and not future.done():
                future.set_result(None)
        else:
            super()._on_message(op, message)

    def _send(self, message: dict[str, Any]) -> None:
        """To a child that is up: one that is starting is told everything in `_started`."""
        if self.ready and self._writer is not None and not self._writer.is_closing():
            self._writer.write(orjson.dumps(message) + b"\n")


# --- the child's side ----------------------------------------------------------------------


def main(fd: int) -> None:
    """Entry point of the export process: `fd` is its end of the socket pair."""
    started = receive_payload(fd)
    settings, _ = started.payload
    run_helper(
        functools.partial(_serve, started),
        started,
        name="export process",
        priority=settings.export_priority,
        log_level=settings.log_level,
        grace=settings.shutdown_grace,
        whole_process=False,  # the threads that work lower themselves (`_work_threads`)
    )


def _work_threads(priority: str) -> Callable[[], None] | None:
    """What each working thread runs first: lower its own priority (Linux: per thread)."""
    if priority == "normal" or not PER_THREAD_PRIORITY:
        return None
    return functools.partial(lower_thread, priority)


async def _serve(started: Started, life: Lifeline) -> None:
    from trace_proxy.exporters import create_exporters

    settings, spool_dir = started.payload
    loop = asyncio.get_running_loop()
    life.attach(loop)
    lower = _work_threads(settings.export_priority)
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="export-work",
                                                 initializer=lower))  # fmt: skip
    reader, writer = await asyncio.open_connection(sock=started.sock, limit=1 << 20)

    def send(message: dict[str, Any]) -> None:
        if not writer.is_closing():
            writer.write(orjson.dumps(message) + b"\n")

    metrics = ExportMetrics()
    try:  # SDK imports and tokenizers load in the working threads, at their priority
        exporters = await loop.run_in_executor(None, create_exporters, settings)
        runner = export_runner(settings, spool_dir, metrics, exporters, lower)
        token2text = await add_token2text(settings, runner, metrics)
        await runner.start(lambda detail: send({"op": "starting", "detail": detail}))
    except (ConfigError, TokenizerError, SpoolBusy) as exc:
        send({"op": "error", "kind": "tokenizer" if isinstance(exc, TokenizerError) else "config",
              "message": str(exc)})  # fmt: skip
        await writer.drain()
        writer.close()
        return
    life.holding()
    send({"op": "ready"})
    report = _Report(metrics, send)
    runner.before_commit = report.now
    tasks = {loop.create_task(report.every(METRICS_EVERY))}
    if needs_discovery(token2text):
        tasks.add(loop.create_task(_discover(settings, token2text, send)))
    else:
        send({"op": "discovered"})
    hurry = functools.partial(_hurry, runner, settings.export_priority)
    reading = loop.create_task(_read(reader, runner, metrics, send, tasks, hurry))
    ended = loop.create_task(life.ended())
    try:
        await asyncio.wait({reading, ended}, return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            asked = reading.result()
            timeout = life.parent_gone() if asked is None else asked
        else:  # SIGTERM, or the parent is gone while we were busy
            reading.cancel()
            timeout = ended.result()
    finally:  # asked to stop, or the proxy is gone: export what we can, then leave
        ended.cancel()
        for task in tasks:
            task.cancel()
        _hurry(runner, settings.export_priority)
        await runner.close(timeout)
        send({"op": "metrics", "text": generate_latest(metrics.registry).decode()})
        send({"op": "stopped"})
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


async def _read(
    reader: asyncio.StreamReader,
    runner: ExportRunner,
    metrics: ExportMetrics,
    send: Callable[[dict[str, Any]], None],
    tasks: set[asyncio.Task[None]],
    hurry: Callable[[], None],
) -> float | None:
    """The proxy's messages, until `stop` (its timeout) or the end of the socket (None)."""
    loop = asyncio.get_running_loop()
    while line := await reader.readline():
        message = orjson.loads(line)
        op = message["op"]
        if op == "data":
            runner.notify(message["end"])
        elif op == "flush":
            tasks.add(loop.create_task(_flush(runner, metrics, message, send)))
        elif op == "hurry":
            hurry()
        elif op == "stop":
            return float(message["timeout"])
    return None


def _hurry(runner: ExportRunner, priority: str) -> None:
    """Shutdown has begun: export at the proxy's priority from now on (once)."""
    if runner.hurried or priority == "normal":
        return
    if not PER_THREAD_PRIORITY:  # pragma: no cover - other platforms
        log.info("the export process cannot raise its priority here: it drains at %s", priority)
        return
    runner.hurry(name_thread)
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="export-work", initializer=name_thread)
    )
    log.info("the export process drains the spool at the proxy's priority")


async def _flush(
    runner: ExportRunner, metrics: ExportMetrics, message: dict[str, Any], send: Any
) -> None:
    await runner.flush(message["end"])
    send({"op": "metrics", "text": generate_latest(metrics.registry).decode()})
    send({"op": "flushed", "id": message["id"]})


class _Report:
    """Sends the export metrics to the proxy when they changed: every so often, and before a
    cursor moves past what was counted (a SIGKILL after the move loses nothing counted)."""

    def __init__(self, metrics: ExportMetrics, send: Callable[[dict[str, Any]], None]) -> None:
        self._metrics = metrics
        self._send = send
        self._last = ""

    def now(self) -> None:
        text = generate_latest(self._metrics.registry).decode()
        if text != self._last:
            self._send({"op": "metrics", "text": text})
            self._last = text

    async def every(self, seconds: float) -> None:
        while True:
            self.now()
            await asyncio.sleep(seconds)


async def _discover(settings: Settings, token2text: Token2Text, send: Any) -> None:
    await discover_served(settings, token2text.tokenizers)
    send({"op": "discovered"})


if __name__ == "__main__":
    main(int(sys.argv[1]))
