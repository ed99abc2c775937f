"""What the simulated vLLM and the fake SGLang share as servers: knobs, logs, lifecycle.

Tests inspect what a server received and which requests a client abandoned; both fakes record
the same way and start the same way (handler cancellation on, so a disconnect is seen).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .engine import Engine, Flight
from .model import TextModel
from .wire import DEFAULT_MAX_MODEL_LEN, FIXED_CREATED, hex_digest, json_response, random_uuid


@dataclass
class RecordedRequest:
    """A request as the server received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None


class AbortLog:
    """Request ids whose generation was cut short because the client went away."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._changed = asyncio.Event()

    def record(self, request_id: str) -> None:
        self.ids.append(request_id)
        self._changed.set()

    async def wait(self, count: int = 1, timeout: float = 5.0) -> list[str]:
        """Wait until at least `count` aborts were recorded; TimeoutError otherwise."""

        async def reached() -> None:
            while len(self.ids) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(reached(), timeout)
        return list(self.ids)


async def start_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Serve `app` with handler cancellation on, so a client disconnect cancels generation."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host}:{bound}"


class SimulatedServer:
    """What the simulated vLLM and the fake SGLang share: knobs, logs, engine, lifecycle."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        model: str = "tiny-qwen",
        deterministic: bool = False,
        token_delay: float = 0.0,
        keepalive_comments: bool = False,
        error_after_chunks: int | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        split_words: bool = False,
    ) -> None:
        self.model = model
        self.deterministic = deterministic
        self.keepalive_comments = keepalive_comments
        self.error_after_chunks = error_after_chunks
        self.text = TextModel(tokenizer, max_model_len, split_words)
        self.engine = Engine(token_delay)
        self.requests: list[RecordedRequest] = []
        self.abort_log = AbortLog()

    @property
    def token_delay(self) -> float:
        return self.engine.token_delay

    @token_delay.setter
    def token_delay(self, value: float) -> None:
        self.engine.token_delay = value

    @property
    def aborted(self) -> list[str]:
        """Ids of requests aborted because the client disconnected mid-generation."""
        return self.abort_log.ids

    async def wait_aborted(self, count: int = 1, timeout: float = 5.0) -> list[str]:
        """Wait for `count` client-disconnect aborts; returns every aborted id so far."""
        return await self.abort_log.wait(count, timeout)

    async def wait_in_flight(self, count: int = 1, timeout: float = 5.0) -> None:
        """Wait until `count` requests are generating (e.g. before disconnecting a client)."""
        await self.engine.wait_in_flight(count, timeout)

    def created(self) -> int:
        return FIXED_CREATED if self.deterministic else int(time.time())

    def new_id(self, body: bytes, *salt: str, size: int = 8) -> str:
        """A random id, or in deterministic mode one derived from the request body."""
        if self.deterministic:
            return hex_digest(body, *salt, size=size)
        return random_uuid() if size == 8 else uuid.uuid4().hex[: 2 * size]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record], client_max_size=1 << 30)
        self.add_routes(app)
        return app

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
        """Start serving; returns the runner (call `cleanup()`) and the base URL."""
        return await start_app(self.app(), host, port)

    @asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """`async with sim.serve() as base_url:` — started and cleaned up around the block."""
        runner, url = await self.start(host, port)
        try:
            yield url
        finally:
            await runner.cleanup()

    @web.middleware
    async def _record(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            RecordedRequest(
                request.method, request.path, dict(request.query), dict(request.headers), body
            )
        )
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPNotFound:
            return json_response({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return json_response({"detail": "Method Not Allowed"}, 405)
        return response

    async def track(
        self, flight: Flight, request_ids: Sequence[str], run: Callable[[], Any]
    ) -> Any:
        """Run a generation; a client disconnect (cancel or reset) is recorded as an abort."""
        try:
            return await run()
        except (asyncio.CancelledError, ConnectionResetError):
            flight.aborted = True
            for request_id in request_ids:
                self.abort_log.record(request_id)
            raise
        finally:
            self.engine.release(flight)

    async def steps(self, flight: Flight, longest: int) -> AsyncIterator[int]:
        """Token steps 0..longest-1, stopping early if the request is aborted."""
        for step in range(longest):
            if not await self.engine.tick(flight):
                return
            yield step
