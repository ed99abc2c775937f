"""What a client may take: time to send a request's head and body, and the size of its head.

aiohttp's server times none of this: its keep-alive timer runs only between requests (about an
hour by default), so a client that sends its headers a byte at a time, or its body a byte a
minute, holds a connection and a handler for as long as it likes. The listener here is
aiohttp's `web.Server` with a request handler that also

- times a request's line and headers from their first byte (a connection's first request from
  the moment it connects): when they are not all in after `header_timeout`, the client gets
  a 408 (nothing at all if it sent nothing) and the connection is closed;
- times a request's body from the end of its headers: after `body_timeout`, reading it fails
  with `RequestBodyTimeout`, which the forwarder answers with a 408, closing the connection;
- answers a request line or header line over `max_header_size`, or more than `max_headers`
  header lines, with 431 instead of aiohttp's 400, without the offending bytes in the answer;
- answers a request that is not valid HTTP/1.1 (a bad header line, a bad Content-Length or
  chunk size) with 400, counted as `bad_request`, instead of a traceback in the log for each.

Only the request side is timed: a streamed response lasts as long as the generation does.
Each refusal is counted by reason and logged once per reason, not once per request: a flood
of them must not flood the log, and no log line holds a byte of the offending head (a long
`Authorization` header is a credential). The admin port and the viewer are served the same way
(`LimitedAppRunner`): aiohttp's own handler logs a traceback quoting the head for each.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from prometheus_client import Counter

from trace_proxy.logtext import printable
from trace_proxy.metrics import children

if TYPE_CHECKING:
    from trace_proxy.config import Settings

log = logging.getLogger(__name__)


class RequestBodyTimeout(asyncio.TimeoutError):
    """The client did not send the request's body in time (raised by reads of the body)."""


@dataclass(frozen=True)
class ClientLimits:
    header_timeout: float | None  # seconds; None: no limit
    body_timeout: float | None
    max_header_size: int  # bytes of the request line, and of each header line
    max_headers: int

    @classmethod
    def of(cls, settings: Settings) -> ClientLimits:
        """What a client may take, on every port (`--client-*-timeout`, `--max-header*`)."""
        return cls(
            header_timeout=settings.client_header_timeout,
            body_timeout=settings.client_body_timeout,
            max_header_size=settings.max_header_size,
            max_headers=settings.max_headers,
        )


class Rejections:
    """Counts what the limits turn away, by reason, and logs each reason the first time.

    `counter`: a metric labelled by reason (None where nothing is exported, as in the
    viewer); `port`: which listener, as its log lines name it."""

    def __init__(self, counter: Counter | None, port: str = "the proxy port") -> None:
        self._counter = children(counter) if counter is not None else None
        self._name = next(iter(counter.describe())).name if counter is not None else None
        self._port = port
        self._logged: set[str] = set()

    def __call__(self, reason: str, what: str) -> None:
        if self._counter is not None:
            self._counter(reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            counted = (
                f'every time is counted in {self._name}{{reason="{reason}"}}'
                if self._name is not None
                else "every time is answered the same"
            )
            log.warning("%s: %s (logged once; %s)", self._port, what, counted)


_TIMEOUT_BODY = b"408 Request Timeout: the request headers did not arrive in time\n"
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class LimitedServer(web.Server):
    """`web.Server` whose connections are `LimitedHandler`s."""

    def __init__(
        self, handler: Any, limits: ClientLimits, rejections: Rejections, **kwargs: Any
    ) -> None:
        super().__init__(
            handler,
            max_line_size=limits.max_header_size,
            max_field_size=limits.max_header_size,
            max_headers=limits.max_headers,
            **kwargs,
        )
        self.limits = limits
        self.rejections = rejections

    def __call__(self) -> RequestHandler:
        return LimitedHandler(self, loop=self._loop, **self._kwargs)


class LimitedAppRunner(web.AppRunner):
    """An `Application` (the admin port, the viewer) served by a `LimitedServer`, with the
    same limits and answers as the proxy port; routing and middlewares are the app's."""

    def __init__(
        self, app: web.Application, limits: ClientLimits, rejections: Rejections, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self._rejections = rejections

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app started and frozen, its handler made
        return LimitedServer(
            plain.request_handler,
            self._limits,
            self._rejections,
            request_factory=plain.request_factory,
            loop=plain._loop,
            **plain._kwargs,
        )


class LimitedHandler(RequestHandler):
    """One connection, with the request-side timers and the 431 answer."""

    __slots__ = ("_body_timer", "_head_timer", "_limits", "_partial_head", "_rejections")

    def __init__(self, manager: LimitedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._rejections = manager.rejections
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._partial_head = False  # bytes of a request's head have come, not all of it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._time_head()  # a connection that never sends a byte is timed too

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Between requests (the handler waits for the next head), and before a connection's
        # first request is complete, bytes are a head's.
        waiter = self._waiter
        idle = (waiter is not None and not waiter.done()) or self._request_count == 0
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # heads complete: their bodies' time starts
            self._partial_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._limits.body_timeout is not None:
                for _, payload in list(self._messages)[queued:]:
                    self._time_body(payload)
        elif idle and data:
            self._partial_head = True
            if self._head_timer is None:
                self._time_head()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, BadHttpMessage) and not _head_too_large(exc):
            return self._bad_request(exc)
        if not _head_too_large(exc):
            return super().handle_error(request, status, exc, message)
        limits = self._limits
        self._rejections(
            "header_too_large",
            f"a request line or header line over {limits.max_header_size} bytes, or more than "
            f"{limits.max_headers} header lines (--max-header-size, --max-headers): answered "
            "431, not forwarded",
        )
        response = web.Response(
            status=431,
            text=f"431 Request Header Fields Too Large: at most {limits.max_header_size} bytes "
            f"per request line or header line, and {limits.max_headers} header lines\n",
        )
        response.force_close()
        return response

    def _bad_request(self, exc: BadHttpMessage) -> web.StreamResponse:
        self._rejections(
            "bad_request",
            "a request that is not valid HTTP/1.1 (aiohttp's parser: "
            f"{_first_line(exc.message)}): answered 400, not forwarded",
        )
        response = web.Response(status=400, text="400 Bad Request: not valid HTTP/1.1\n")
        response.force_close()
        return response

    def _time_head(self) -> None:
        timeout = self._limits.header_timeout
        if timeout is not None and not self._force_close:
            self._head_timer = self._loop.call_later(timeout, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        waiter = self._waiter
        transport = self.transport
        if transport is None or self._force_close or waiter is None or waiter.done():
            return  # a request arrived meanwhile, or the connection is gone
        self._rejections(
            "header_timeout",
            f"a client did not send a request's headers within {self._limits.header_timeout:g} "
            "s (--client-header-timeout): answered 408 (nothing, if it sent nothing) and closed",
        )
        if self._partial_head:  # a connection that sent nothing is closed without a word
            transport.write(REQUEST_TIMEOUT)
        self.force_close()  # after the 408 is written

    def _time_body(self, payload: StreamReader) -> None:
        timeout = self._limits.body_timeout
        if timeout is None or payload.is_eof():
            return  # the usual case: the whole body came with its head
        if self._body_timer is not None:
            self._body_timer.cancel()
        timer = self._body_timer = self._loop.call_later(timeout, self._body_too_slow, payload)
        payload.on_eof(timer.cancel)

    def _body_too_slow(self, payload: StreamReader) -> None:
        self._body_timer = None
        if payload.is_eof() or payload.exception() is not None or self.transport is None:
            return
        timeout = self._limits.body_timeout
        assert timeout is not None
        self._rejections(
            "body_timeout",
            f"a client did not send a request's body within {timeout:g} s "
            "(--client-body-timeout): answered 408 and closed",
        )
        payload.set_exception(
            RequestBodyTimeout(f"the request body did not arrive within {timeout:g} s")
        )

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None


def _first_line(message: str) -> str:
    """The parser's reason without the offending bytes it quotes on the following lines
    (and what its first line may quote, escaped)."""
    return printable(message.strip().splitlines()[0][:120]) if message.strip() else "unknown"


def _head_too_large(exc: BaseException | None) -> bool:
    if isinstance(exc, LineTooLong):
        return True
    return isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message
