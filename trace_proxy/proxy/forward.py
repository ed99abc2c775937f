"""The hot path: forward one request to its upstream and stream the answer back untouched.

It only forwards and copies. Bytes go out as they arrive (each SSE event reaches the client as
soon as the upstream sends it); references to the same bytes are kept for the capture stage,
which gets them only after the response is finished. Nothing here parses a body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import orjson
from aiohttp import StreamReader, web

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import PATH_PREFIX, MetadataResolver, split_rollout_prefix
from trace_proxy.capture.routes import RouteKind, classify
from trace_proxy.logtext import printable
from trace_proxy.metrics import Metrics, children
from trace_proxy.proxy.headers import (
    client_response_headers,
    upstream_request_fields,
)
from trace_proxy.proxy.limits import RequestBodyTimeout
from trace_proxy.proxy.upstream_client import UpstreamClient, UpstreamConnection, UpstreamError
from trace_proxy.proxy.upstreams import (
    UPSTREAM_HEADER,
    RegisteredUpstreams,
    Upstream,
    UpstreamPool,
)

log = logging.getLogger(__name__)
STREAM_BODY_ABOVE = 256 * 1024  # bytes; below this, one read beats streaming
ALLOWED_METHODS = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"  # for a 405's Allow


class Forwarder:
    def __init__(
        self,
        pool: UpstreamPool,
        client: UpstreamClient,
        resolver: MetadataResolver,
        submit: Callable[[Exchange], None],
        admit: Callable[[Exchange], bool],
        metrics: Metrics,
        tool_routes: dict[str, Upstream] | None = None,
        capture_max_body: int = 128 << 20,
        registered: RegisteredUpstreams | None = None,
    ) -> None:
        """`capture_max_body`: body bytes of one exchange kept for capture; past it the
        exchange goes to capture without its bodies (`Exchange.bodies_skipped`).
        `registered`: upstreams a request may name by id (`X-Trace-Proxy-Upstream`)."""
        self._registered = registered
        self._logged_refusals: set[str] = set()
        self._tool_routes = tool_routes or {}
        self._max_body = capture_max_body
        self._skipped = children(metrics.capture_skipped_bodies)
        self._logged_skip = False
        self._pool = pool
        self._client = client
        self._resolver = resolver
        self._submit = submit
        self._admit = admit
        self._metrics = metrics
        self._in_flight = children(metrics.in_flight)
        self._requests = children(metrics.requests)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        start = time.time()
        if request.method == "CONNECT":  # a tunnel to where the client says: never
            return self._refuse(
                405,
                "connect",
                "trace-proxy is a reverse proxy: CONNECT is not forwarded",
                {"Allow": ALLOWED_METHODS},
            )
        target = request.raw_path
        if not target.startswith("/"):  # absolute-form target: only its path and query count
            target = str(request.rel_url)
            if not target.startswith("/"):  # `OPTIONS *`, or no path at all
                return self._refuse(
                    400,
                    "target",
                    "trace-proxy forwards requests for a path only (not `*` or an authority)",
                )
        path_items: list[tuple[str, str]] = []
        if target.startswith(PATH_PREFIX):
            target, path_items = split_rollout_prefix(target)
        parsed_as: str | None = None  # the route without what a `path:` rule matched
        if self._resolver.path_rules:
            target, parsed_as, mapped = self._resolver.map_path(target)
            path_items = [*path_items, *mapped] if mapped else path_items
        path, _, query = target.partition("?")
        tool_prefix = path[1:].split("/", 1)[0] if self._tool_routes else ""
        if tool_prefix in self._tool_routes:
            kind = RouteKind.TOOL
            upstream = self._tool_routes[tool_prefix]
            upstream.in_flight += 1
            target = "/" + target[len(tool_prefix) + 1 :].lstrip("/")
            path = target.partition("?")[0]
        else:
            tool_prefix = ""
            path = parsed_as or path
            kind = classify(request.method, path)
            named = request.headers.get(UPSTREAM_HEADER)
            if named is not None or not self._pool.upstreams:
                chosen = self._registered.get(named) if self._registered and named else None
                if chosen is None:
                    return self._misdirected(kind, named)
                upstream = chosen
                upstream.in_flight += 1
            else:
                affinity = ""
                if self._pool.sticky:
                    affinity = self._resolver.affinity_key(request.headers, path_items)
                upstream = self._pool.acquire(affinity)
        in_flight = self._in_flight(upstream.base)
        in_flight.inc()
        exchange = None
        if kind is not RouteKind.OTHER:
            exchange = Exchange(
                method=request.method,
                path=path,
                query=query,
                request_headers=request.headers,
                path_metadata=path_items,
                upstream=upstream.base,
                start=start,
                tool_route=tool_prefix or None,
            )
            if kind is RouteKind.GENERATE and not self._admit(exchange):
                exchange = None  # a dropped sample: forwarded, and nothing more
        try:
            return await self._forward(request, upstream, target, kind, exchange, start)
        finally:
            in_flight.dec()
            self._pool.release(upstream)
            if exchange is not None:
                if exchange.bodies_skipped is not None:
                    self._skipped_body(exchange.bodies_skipped)
                self._submit(exchange)

    def _misdirected(self, kind: RouteKind, named: str | None) -> web.Response:
        """421, not forwarded: the request names no upstream this proxy was given (by its
        command line, or registered over the admin port). Nothing a request says can send it
        anywhere else."""
        if named is None:
            message = (
                "trace-proxy: no upstream is configured; "
                f"name a registered one in {UPSTREAM_HEADER}"
            )
        else:
            message = f"trace-proxy: {UPSTREAM_HEADER} names no registered upstream"
        return self._refuse(421, "misdirected_request", message, kind=kind)

    def _refuse(
        self,
        status: int,
        reason: str,
        message: str,
        headers: dict[str, str] | None = None,
        kind: RouteKind = RouteKind.OTHER,
    ) -> web.Response:
        """An answer of the proxy's own, for a request it does not forward: counted as a 4xx
        request, logged once per reason (the message holds nothing the request said)."""
        self._requests(kind.value, "4xx").inc()
        if reason not in self._logged_refusals:
            self._logged_refusals.add(reason)
            log.warning("%s: answered %d (logged once; every time is counted as a 4xx "
                        "request)", message, status)  # fmt: skip
        payload = {"error": {"message": message, "type": reason, "code": status}}
        return web.Response(
            status=status,
            body=orjson.dumps(payload),
            content_type="application/json",
            headers=headers,
        )

    def _skipped_body(self, reason: str) -> None:
        self._skipped("body_too_large").inc()
        if not self._logged_skip:
            self._logged_skip = True
            log.warning(
                "%s (logged once; every time is counted in "
                'trace_proxy_capture_skipped_bodies{reason="body_too_large"})',
                reason,
            )

    async def _forward(
        self,
        request: web.BaseRequest,
        upstream: Upstream,
        target: str,
        kind: RouteKind,
        exchange: Exchange | None,
        start: float,
    ) -> web.StreamResponse:
        fields = upstream_request_fields(
            request.raw_headers, request.remote, request.scheme, request.host
        )
        response: web.StreamResponse | None = None
        upstream_response: UpstreamConnection | None = None
        try:
            body = await _request_body(request, exchange, self._max_body)
            upstream_response = await self._client.request(
                upstream.base, request.method, target, fields, body
            )
            status = upstream_response.status
            response = web.StreamResponse(
                status=status,
                reason=upstream_response.reason or None,
                headers=client_response_headers(upstream_response.header_items),
            )
            await response.prepare(request)
            first_byte = time.time()
            self._metrics.added_latency.observe(first_byte - start)
            chunks = None
            room = 0  # body bytes the tap may still keep
            if exchange is not None:
                exchange.status = status
                exchange.response_headers = upstream_response.headers
                exchange.first_byte = first_byte
                if exchange.bodies_skipped is None:
                    chunks = exchange.response_chunks
                    room = self._max_body - len(exchange.request_body)
            read = upstream_response.read
            while chunk := await read():
                if chunks is not None:
                    room -= len(chunk)
                    if room >= 0:
                        chunks.append(chunk)
                    else:  # a record is not worth holding a body this large in memory
                        chunks = None
                        _skip_bodies(exchange, "response", self._max_body)
                await response.write(chunk)
            await response.write_eof()
        except asyncio.CancelledError:
            self._note(exchange, kind, "client disconnected", None)
            raise
        except UpstreamError as exc:
            return self._fail(request, response, exchange, kind, upstream, exc)
        except RequestBodyTimeout as exc:  # counted and logged by the listener (limits.py)
            return self._client_too_slow(request, response, exchange, kind, str(exc))
        except ConnectionResetError as exc:  # writing to a client that has left
            self._note(exchange, kind, "client disconnected", None)
            raise asyncio.CancelledError from exc
        finally:
            if upstream_response is not None:
                upstream_response.release()
        self._note(exchange, kind, None, response.status)
        return response

    def _note(
        self, exchange: Exchange | None, kind: RouteKind, error: str | None, status: int | None
    ) -> None:
        if exchange is not None:
            exchange.end = time.time()
            exchange.error = exchange.error or error
        status_class = f"{status // 100}xx" if status else "none"
        self._requests(kind.value, status_class).inc()

    def _client_too_slow(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse | None,
        exchange: Exchange | None,
        kind: RouteKind,
        detail: str,
    ) -> web.StreamResponse:
        """408, as nginx answers a body that does not arrive; the connection is closed, since
        the rest of the body may still come."""
        self._note(exchange, kind, f"client too slow: {detail}", 408)
        if response is not None:  # not expected: the body is sent before the answer starts
            if request.transport is not None:
                request.transport.abort()
            return response
        if exchange is not None:
            exchange.status = 408
        payload = {
            "error": {"message": f"trace-proxy: {detail}", "type": "client_timeout", "code": 408}
        }
        answer = web.Response(
            status=408, body=orjson.dumps(payload), content_type="application/json"
        )
        answer.force_close()
        return answer

    def _fail(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse | None,
        exchange: Exchange | None,
        kind: RouteKind,
        upstream: Upstream,
        exc: UpstreamError,
    ) -> web.StreamResponse:
        cause, detail = exc.cause, exc.detail
        status = 504 if cause == "timeout" else 502
        self._metrics.upstream_errors.labels(upstream.base, cause).inc()
        log.warning("%s %s -> %s: %s", request.method, printable(request.path), upstream.base,
                    printable(detail))  # fmt: skip
        if response is not None:
            # Headers are already on their way: the only honest signal left is a cut
            # connection, so the client sees a failed response, not a short complete one.
            self._note(exchange, kind, f"upstream {cause} mid-response: {detail}", None)
            if request.transport is not None:
                request.transport.abort()
            return response
        self._note(exchange, kind, f"upstream {cause}: {detail}", status)
        if exchange is not None:
            exchange.status = status
        payload = {
            "error": {
                "message": f"trace-proxy: upstream {upstream.base} {_CAUSE_TEXT[cause]}: {detail}",
                "type": f"upstream_{cause}",
                "code": status,
                "upstream": upstream.base,
            }
        }
        return web.Response(
            status=status, body=orjson.dumps(payload), content_type="application/json"
        )


async def _request_body(
    request: web.BaseRequest, exchange: Exchange | None, max_body: int
) -> bytes | AsyncIterator[bytes] | None:
    """A small body in one read (one write upstream); a large one streamed as it arrives, so
    the upstream starts reading before the client has finished sending. Not `request.read()`:
    that caps bodies at 1 MiB, and token-id prompts are larger. The tap keeps at most
    `max_body` bytes of it."""
    if not request.body_exists:
        return None
    length = request.content_length
    if length is not None and length <= STREAM_BODY_ABOVE:
        body = await request.content.read()
        if exchange is not None:
            if len(body) <= max_body:
                exchange.request_body = body
            else:
                _skip_bodies(exchange, "request", max_body)
        return body
    return _stream_body(request.content, exchange, max_body)


async def _stream_body(
    content: StreamReader, exchange: Exchange | None, max_body: int
) -> AsyncIterator[bytes]:
    chunks: list[bytes] | None = [] if exchange is not None else None
    room = max_body
    async for chunk in content.iter_any():
        if chunks is not None:
            room -= len(chunk)
            if room >= 0:
                chunks.append(chunk)
            else:
                chunks = None
                _skip_bodies(exchange, "request", max_body)
        yield chunk
    if exchange is not None and chunks is not None:
        exchange.request_body = b"".join(chunks)


def _skip_bodies(exchange: Exchange | None, which: str, max_body: int) -> None:
    """Let go of what the tap kept: the call is recorded without bodies, saying why."""
    if exchange is not None:
        exchange.request_body = b""
        exchange.response_chunks = []
        exchange.bodies_skipped = (
            f"the {which} body is over the {max_body}-byte capture limit "
            "(--capture-max-body): bodies not recorded"
        )


_CAUSE_TEXT = {
    "unreachable": "could not be reached",
    "timeout": "timed out",
    "reset": "reset the connection",
}
