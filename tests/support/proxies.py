"""Running a real proxy (and small scripted upstreams) inside a test, and reading its store."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from fakes.serving import serve_app
from prometheus_client.parser import text_string_to_metric_families

from trace_proxy.config import Settings
from trace_proxy.exporters.pipeline import ExportPipeline
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import SpoolWriter
from trace_proxy.metrics import ExportMetrics, Metrics, exposition
from trace_proxy.processes import text_path
from trace_proxy.proxy.service import ProxyService
from trace_proxy.store.readers import iter_records

HOLD_GUARD = 60.0  # seconds: a failure bound, not a synchronisation


class HeldLoader:
    """`load_configured` (the `--tokenizer` loading of a proxy in this process), held until
    `release`: the tokenizer is surely loading meanwhile. Patch it in with
    `monkeypatch.setattr(text_path, "load_configured", HeldLoader())`."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.real = text_path.load_configured

    def __call__(self, sources: list[str], skip_special_tokens: bool) -> Any:
        if not self.released.wait(HOLD_GUARD):
            raise AssertionError("the test never let the tokenizer load")
        return self.real(sources, skip_special_tokens)


def release_as_stop_begins(service: ProxyService, loader: HeldLoader) -> None:
    """The tokenizer finishes loading only once the proxy (its recorder in this process) is
    stopping: a client whose whole run fitted in the first seconds after the start, then the
    end of the training script."""
    stop = service.recorder.stop

    async def stop_then_load(*args: Any, **kwargs: Any) -> None:
        loader.released.set()
        await stop(*args, **kwargs)

    service.recorder.stop = stop_then_load  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def running_proxy(
    upstreams: list[str], output: Path, **overrides: Any
) -> AsyncIterator[tuple[ProxyService, str]]:
    """A proxy on free loopback ports, once ready (its helper processes up: what cannot start
    raises here); stopping it (on exit) flushes every record."""
    settings = dataclasses.replace(
        Settings(), upstream=upstreams, port=0, admin_port=0, output=output, **overrides
    )
    service = ProxyService(settings)
    try:
        addresses = await service.start()
        await service.wait_ready()
        yield service, addresses.proxy
    finally:
        await service.stop()


@contextlib.asynccontextmanager
async def scripted_upstream(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A one-handler upstream for fault injection (slow, silent, broken): every path, any method."""
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serve_app(app, handler_cancellation=True) as url:
        yield url


def trajectories(output: Path) -> list[dict[str, Any]]:
    return [r for _, r in iter_records(output) if r.get("record") == "trajectory"]


def events(output: Path) -> list[dict[str, Any]]:
    return [r for _, r in iter_records(output) if r.get("record") == "event"]


def all_calls(output: Path) -> list[dict[str, Any]]:
    return [c for t in trajectories(output) for c in t["calls"]]


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def inline_pipeline(
    spool_dir: Path,
    exporters: list[Any],
    *,
    processors: list[Any] | None = None,
    max_bytes: int = 1 << 30,
    segment_bytes: int | None = None,
    batch_size: int = 64,
) -> tuple[ExportPipeline, Metrics]:
    """An export pipeline with its exporters in this process, retrying quickly and never
    lingering for a batch to gather (fault tests)."""
    metrics = Metrics()
    runner = ExportRunner(
        spool_dir,
        exporters,
        ExportMetrics(metrics.registry),
        processors=processors,
        batch_size=batch_size,
        backoff=0.001,
        max_backoff=0.01,
        linger=0.0,
    )
    spool = SpoolWriter(spool_dir, max_bytes=max_bytes, segment_bytes=segment_bytes)
    return ExportPipeline(runner, metrics, spool), metrics


def metric(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample as /metrics shows it: this process's, plus what its capture process last
    reported (after a flush or a stop, everything)."""
    for family in text_string_to_metric_families(exposition(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def raw_post(url: str, head: bytes, body: bytes) -> bytes:
    """A POST with header bytes as they are (no client library sends bytes that are not
    UTF-8): `head` is the request line and headers; the status line of the answer."""
    host, _, port = url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return data.partition(b"\r\n")[0]


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (helpers start theirs from a
    thread of their own)."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return found


def gone(pid: int) -> bool:
    """Ended (or a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
