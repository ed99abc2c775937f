"""The export process: exporters and token2text run beside the proxy, not inside it.

Backend SDKs (MLflow, Weave, trackio, OpenTelemetry) and token decoding are CPU work in Python;
in the proxy's process they would hold the interpreter lock against forwarding. Here they run
in a child process (under SCHED_IDLE, so that on a busy machine exporting lags rather than
forwarding) that reads the spool on its own; the proxy only tells it, over a socket
pair, how far the spool goes, and asks it to flush and stop. The child sends back its metrics
(the text format, relayed on the proxy's /metrics) and answers flushes. If it dies, the proxy
starts another, which resumes from the backends' cursors: nothing spooled is lost.

Messages are JSON lines: to the child `data` (the spool's end), `flush`, `stop`; from it
`ready` or `error` (at start), `discovered` (token2text found the served tokenizers),
`metrics`, `flushed`, `stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client import generate_latest

from trace_proxy.child import Helper, receive_payload, run_child
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.metrics import ExportMetrics, Metrics, RelayedMetrics
from trace_proxy.trajectories.discovery import discover_tokenizers
from trace_proxy.trajectories.token2text import Token2Text, TokenizerError, load_configured
from trace_proxy.trajectories.toolparsers import get_parser

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0  # loading tokenizers and SDKs on a cold machine
METRICS_EVERY = 1.0
RESTART_DELAY = 1.0


async def _create_runner(
    settings: Settings, spool_dir: Path, metrics: ExportMetrics, exporters: list[Exporter]
) -> tuple[ExportRunner, Token2Text | None]:
    """The runner for these settings, with token2text when asked (TokenizerError if a
    configured tokenizer cannot be loaded)."""
    runner = ExportRunner(spool_dir, exporters, metrics)
    token2text = None
    if settings.token2text:
        tokenizers = await asyncio.to_thread(
            load_configured, settings.tokenizer, settings.skip_special_tokens
        )
        token2text = Token2Text(
            tokenizers,
            get_parser(settings.tool_parser),
            on_skip=lambda reason: metrics.token2text_skipped.labels(reason).inc(),
        )
        runner.add_processor(token2text)
    return runner, token2text


# --- the proxy's side ----------------------------------------------------------------------


class ExportProcess(Helper):
    """Starts, feeds, supervises and stops the export process; when it dies, another resumes
    from the backends' cursors."""

    name = "export process"
    start_timeout = START_TIMEOUT
    restart_delay = RESTART_DELAY

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
        """Shutdown has begun (the export process acts on it once it knows how)."""
        self._send({"op": "hurry"})

    async def close(self, timeout: float) -> None:
        await self._stop(orjson.dumps({"op": "stop", "timeout": timeout}) + b"\n", timeout + 30)
        for _, future in self._flushes.values():  # nobody is left to answer them
            if not future.done():
                future.set_exception(RuntimeError("the export process has stopped"))
        self._flushes.clear()

    def _started(self) -> None:
        self._send({"op": "data", "end": self._end})
        for flush_id, (end, _) in self._flushes.items():  # asked of a child that died
            self._send({"op": "flush", "id": flush_id, "end": end})

    def _died(self) -> None:
        self._metrics.export_process_restarts.inc()

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
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(orjson.dumps(message) + b"\n")


# --- the child's side ----------------------------------------------------------------------


def main(fd: int) -> None:
    """Entry point of the export process: `fd` is its end of the socket pair."""
    sock, (settings, spool_dir) = receive_payload(fd)
    run_child(_serve(settings, spool_dir, sock), settings.export_priority, settings.log_level)


async def _serve(settings: Settings, spool_dir: Path, sock: socket.socket) -> None:
    from trace_proxy.exporters import create_exporters

    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)

    def send(message: dict[str, Any]) -> None:
        if not writer.is_closing():
            writer.write(orjson.dumps(message) + b"\n")

    metrics = ExportMetrics()
    try:
        exporters = create_exporters(settings)
        runner, token2text = await _create_runner(settings, spool_dir, metrics, exporters)
    except (ConfigError, TokenizerError) as exc:
        send({"op": "error", "kind": "tokenizer" if isinstance(exc, TokenizerError) else "config",
              "message": str(exc)})  # fmt: skip
        await writer.drain()
        writer.close()
        return
    await runner.start()
    send({"op": "ready"})
    loop = asyncio.get_running_loop()
    tasks = {loop.create_task(_report(metrics, send))}
    session = aiohttp.ClientSession()
    if token2text is not None and token2text.tokenizers.empty:
        tasks.add(loop.create_task(_discover(settings, session, token2text, send)))
    else:
        send({"op": "discovered"})
    timeout = settings.shutdown_grace
    try:
        while line := await reader.readline():
            message = orjson.loads(line)
            op = message["op"]
            if op == "data":
                runner.notify(message["end"])
            elif op == "flush":
                tasks.add(loop.create_task(_flush(runner, metrics, message, send)))
            elif op == "stop":
                timeout = float(message["timeout"])
                break
    finally:  # asked to stop, or the proxy is gone: export what we can, then leave
        for task in tasks:
            task.cancel()
        await runner.close(timeout)
        await session.close()
        send({"op": "metrics", "text": generate_latest(metrics.registry).decode()})
        send({"op": "stopped"})
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


async def _flush(
    runner: ExportRunner, metrics: ExportMetrics, message: dict[str, Any], send: Any
) -> None:
    await runner.flush(message["end"])
    send({"op": "metrics", "text": generate_latest(metrics.registry).decode()})
    send({"op": "flushed", "id": message["id"]})


async def _report(metrics: ExportMetrics, send: Any) -> None:
    last = ""
    while True:
        text = generate_latest(metrics.registry).decode()
        if text != last:
            send({"op": "metrics", "text": text})
            last = text
        await asyncio.sleep(METRICS_EVERY)


async def _discover(
    settings: Settings, session: aiohttp.ClientSession, token2text: Token2Text, send: Any
) -> None:
    await discover_tokenizers(
        session, settings.upstream, token2text.tokenizers, settings.skip_special_tokens
    )
    send({"op": "discovered"})


if __name__ == "__main__":
    main(int(sys.argv[1]))
