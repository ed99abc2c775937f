"""Serving a test's aiohttp app on a free loopback port, for as long as a `with` lasts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


@contextlib.asynccontextmanager
async def serve_app(
    app: web.Application, port: int = 0, **runner_options: Any
) -> AsyncIterator[str]:
    """The app's base URL (on `port`, else a free one); stopped (connections closed) on exit."""
    runner = web.AppRunner(app, access_log=None, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
