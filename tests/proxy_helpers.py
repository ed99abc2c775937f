"""Running a real proxy (and small scripted upstreams) inside a test, and reading its store."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from trace_proxy.config import Settings
from trace_proxy.proxy.service import ProxyService
from trace_proxy.show import iter_records


@contextlib.asynccontextmanager
async def running_proxy(
    upstreams: list[str], output: Path, **overrides: Any
) -> AsyncIterator[tuple[ProxyService, str]]:
    """A proxy on free loopback ports; stopping it (on exit) flushes every record."""
    settings = dataclasses.replace(
        Settings(), upstream=upstreams, port=0, admin_port=0, output=output, **overrides
    )
    service = ProxyService(settings)
    addresses = await service.start()
    try:
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
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


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
