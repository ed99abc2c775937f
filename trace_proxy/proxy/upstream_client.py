"""The upstream side of the hot path: a small HTTP/1.1 client with a keep-alive pool.

Why not aiohttp's ClientSession: profiling showed its per-request machinery (request and
response objects, tracing signals, cookie and redirect handling, timers per read) as the largest
single cost of forwarding. A proxy needs none of it: one request goes out as one write of a
prebuilt head, the response is parsed by llhttp (through httptools), and body bytes are handed
over as they arrive, de-chunked, with the upstream socket paused while the client is slower.

What it guarantees:
- bytes are passed on as received; nothing is decompressed, re-encoded or reordered;
- a keep-alive connection is reused only after a complete response; anything else closes it;
- a request that fails on a reused connection before any response byte arrived (the upstream
  closed it while idle) is retried once on a new connection when its body can be replayed;
- connect and read timeouts and every failure end as an `UpstreamError` naming its cause:
  `unreachable` (502), `timeout` (504) or `reset` (502).
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

READ_HIGH_WATER = 1 << 18  # bytes buffered for a slow client before the upstream is paused
# (and resumed once the client has taken all of them)
NO_BODY_STATUS = frozenset({204, 304})
# An upstream's status line and headers, at most (nginx's proxy_buffer_size is 4-8 KiB; vLLM
# and SGLang send a few hundred bytes): past it the response is a 502, never held in memory.
MAX_RESPONSE_HEAD = 1 << 20


class UpstreamError(Exception):
    """Why an upstream exchange failed; `cause` is one of unreachable, timeout, reset."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail


class Origin:
    """Where a base URL's connections go, parsed once per upstream."""

    __slots__ = ("base_path", "host", "host_header", "key", "port", "ssl")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) upstream URL: {base!r}")
        self.host = parts.hostname
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        self.base_path = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2]  # never forward userinfo
        self.key = (self.host, self.port, self.ssl)


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection; while a request is on it, it is also that request's response."""

    def __init__(self, pool: UpstreamClient, origin_key: tuple[str, int, bool]) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.origin_key = origin_key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.reused = False
        self.idle_since = 0.0
        # The response in progress.
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.header_items: list[tuple[str, str]] = []  # as received, in order
        self._parser: httptools.HttpResponseParser | None = None
        self._head_request = False
        self._informational = False
        self._headers_done: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._close_delimited = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._received_any = False
        self._head_bytes = 0  # received before the response head was complete
        self._last_data = 0.0
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._writing_paused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self._complete:
            # Bytes nobody asked for: the connection can no longer be trusted.
            self.abort()
            return
        self._received_any = True
        self._last_data = self._loop.time()
        if self._headers_done is not None and not self._headers_done.done():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_RESPONSE_HEAD:
                detail = f"the response head exceeds {MAX_RESPONSE_HEAD} bytes"
                self._fail(UpstreamError("reset", detail))
                return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("reset", "the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("reset", f"invalid HTTP response: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_read_timer()
        self._wake_writer()
        if self._parser is None or self._complete:
            return
        if self._headers_done is not None and self._headers_done.done() and self._close_delimited:
            self._finish()  # a body that ends with the connection
            return
        detail = "the upstream closed the connection"
        if exc is not None:
            detail = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
        self._fail(UpstreamError("reset", detail or "the connection was lost"))

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_writer()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.header_items = []

    def on_status(self, status: bytes) -> None:
        self.reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_items.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 1xx: not forwarded, the final response follows
            return
        self.status = status
        self.headers = CIMultiDict(self.header_items)
        self._keep_alive = self._parser.should_keep_alive()
        no_body = self._head_request or status in NO_BODY_STATUS
        self._close_delimited = (
            not no_body
            and "Content-Length" not in self.headers
            and "Transfer-Encoding" not in self.headers
        )
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_result(None)
        if no_body:
            self._finish()  # llhttp would wait for the body a HEAD response announces

    def on_body(self, body: bytes) -> None:
        if self._complete:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self._finish()

    # The request

    async def send(
        self,
        head: bytes,
        body: bytes | AsyncIterator[bytes] | None,
        chunked: bool,
        head_request: bool,
        read_timeout: float | None,
    ) -> None:
        """Write the request and wait for the response head."""
        assert self.transport is not None
        self._reset(head_request)
        loop = self._loop
        self._headers_done = loop.create_future()
        self._last_data = loop.time()
        if read_timeout is not None:
            self._read_timer = loop.call_at(
                self._last_data + read_timeout, self._check_read_timeout, read_timeout
            )
        if isinstance(body, bytes):
            # One write for the usual case; a large body is not copied just to join it.
            if len(body) < 65536:
                self.transport.write(head + body)
            else:
                self.transport.writelines((head, body))
        else:
            self.transport.write(head)
            if body is not None:
                await self._send_stream(body, chunked)
        await self._headers_done

    async def _send_stream(self, body: AsyncIterator[bytes], chunked: bool) -> None:
        assert self.transport is not None
        async for chunk in body:
            if self._error is not None:
                raise self._error
            if not chunk:
                continue
            if chunked:
                self.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            else:
                self.transport.write(chunk)
            if self._writing_paused:
                self._drain = self._loop.create_future()
                await self._drain
                self._drain = None
        if chunked and self._error is None:
            self.transport.write(b"0\r\n\r\n")

    async def read(self) -> bytes:
        """The next body bytes as they arrived (de-chunked), or b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        if len(chunks) > 1:
            chunks.clear()
        self._buffered = 0
        if self._reading_paused:
            self._reading_paused = False
            if self.transport is not None and not self.lost:
                self.transport.resume_reading()
        return data

    def release(self) -> None:
        """Back to the pool after a complete response, else closed: never reused mid-way."""
        self._cancel_read_timer()
        self._parser = None
        if self._complete and self._keep_alive and not self.lost and self._error is None:
            self._chunks.clear()
            self._pool.put_idle(self)
        else:
            self.abort()

    @property
    def received_nothing(self) -> bool:
        return not self._received_any

    # Internals

    def _reset(self, head_request: bool) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._head_request = head_request
        self._informational = False
        self.status = 0
        self.reason = ""
        self._chunks.clear()
        self._buffered = 0
        self._complete = False
        self._close_delimited = False
        self._keep_alive = False
        self._error = None
        self._received_any = False
        self._head_bytes = 0
        self._reading_paused = False

    def _finish(self) -> None:
        self._complete = True
        self._cancel_read_timer()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._cancel_read_timer()
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_exception(error)
        self._wake_writer()
        self._wake()
        self.abort()

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self) -> None:
        self._cancel_read_timer()
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.lost = True

    def _check_read_timeout(self, timeout: float) -> None:
        """One timer per request, pushed forward lazily, rather than one per read."""
        self._read_timer = None
        if self._complete or self._error is not None:
            return
        due = self._last_data + timeout
        now = self._loop.time()
        if self._reading_paused or now < due:  # data came since, or we are the slow side
            when = now + timeout if self._reading_paused else due
            self._read_timer = self._loop.call_at(when, self._check_read_timeout, timeout)
            return
        self._fail(UpstreamError("timeout", f"no data for {timeout:g} s"))

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None


class UpstreamClient:
    """Keep-alive connections per origin, newest first; idle ones close after `idle_timeout`."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float | None,
        idle_timeout: float = 4.0,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle_timeout = idle_timeout
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self._origins: dict[str, Origin] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def origin(self, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = Origin(base)
        return origin

    async def request(
        self,
        base: str,
        method: str,
        target: str,
        fields: Iterable[tuple[bytes, bytes]],
        body: bytes | AsyncIterator[bytes] | None,
    ) -> UpstreamConnection:
        """Send a request and return once its response head is in; the caller reads the body
        with `read()` and must call `release()` in every case."""
        origin = self.origin(base)
        head, chunked = _request_head(method, origin, target, fields, body)
        head_request = method == "HEAD"
        replayable = not (body is not None and not isinstance(body, bytes))
        while True:
            connection = self._take_idle(origin.key) or await self._connect(origin)
            try:
                await connection.send(head, body, chunked, head_request, self._read_timeout)
                return connection
            except UpstreamError:
                connection.release()
                if connection.reused and connection.received_nothing and replayable:
                    continue  # closed by the upstream while idle: once more, on a new one
                raise
            except BaseException:
                connection.release()
                raise

    def put_idle(self, connection: UpstreamConnection) -> None:
        if self._closed:
            connection.abort()
            return
        connection.reused = True
        connection.idle_since = self.loop.time()
        self._idle.setdefault(connection.origin_key, []).append(connection)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._idle_timeout, self._sweep)

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for connections in self._idle.values():
            for connection in connections:
                if connection.transport is not None and not connection.lost:
                    connection.transport.close()
        self._idle.clear()

    def _take_idle(self, key: tuple[str, int, bool]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not connection.lost:
                return connection
        return None

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        context = None
        if origin.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        connecting = self.loop.create_connection(
            lambda: UpstreamConnection(self, origin.key), origin.host, origin.port, ssl=context
        )
        try:
            _, protocol = await asyncio.wait_for(connecting, self._connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(
                "timeout", f"no connection within {self._connect_timeout:g} s"
            ) from None
        except OSError as exc:
            detail = os.strerror(exc.errno) if exc.errno else str(exc)
            raise UpstreamError("unreachable", detail) from None
        return protocol

    def _sweep(self) -> None:
        self._sweeper = None
        stale_before = self.loop.time() - self._idle_timeout
        remaining = False
        for key, connections in self._idle.items():
            keep = []
            for connection in connections:
                if connection.lost:
                    continue
                if connection.idle_since <= stale_before:
                    assert connection.transport is not None
                    connection.transport.close()
                    connection.lost = True
                else:
                    keep.append(connection)
            self._idle[key] = keep
            remaining = remaining or bool(keep)
        if remaining and not self._closed:
            self._sweeper = self.loop.call_later(self._idle_timeout, self._sweep)


def _request_head(
    method: str,
    origin: Origin,
    target: str,
    fields: Iterable[tuple[bytes, bytes]],
    body: bytes | AsyncIterator[bytes] | None,
) -> tuple[bytes, bool]:
    """The request line and header fields in one buffer, from the bytes the client sent. A body
    read whole gets its exact length; a streamed one keeps the client's Content-Length or,
    without one, goes chunked."""
    line = f"{method} {origin.base_path}{target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
    parts = [line.encode("utf-8", "surrogateescape")]
    has_length = False
    whole = isinstance(body, bytes)
    for name, value in fields:
        if len(name) == 14 and name.lower() == b"content-length":
            if whole:
                continue
            has_length = True
        parts += (name, b": ", value, b"\r\n")
    chunked = False
    if isinstance(body, bytes):
        parts.append(b"Content-Length: %d\r\n" % len(body))
    elif body is not None and not has_length:
        parts.append(b"Transfer-Encoding: chunked\r\n")
        chunked = True
    parts.append(b"\r\n")
    return b"".join(parts), chunked
