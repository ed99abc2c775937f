"""Dispatch: one exchange, taken apart by what its route is, into what the assembler records.

A generate call is parsed by its dialect (`dialects/`), each call with the key hints its
request carries; a control route becomes a step event; a tool server's exchange a tool span;
a session's end closes its trajectory. A body that cannot be parsed is still recorded, as an
unparsed call with the reason, so the trajectory shows that something happened. The stage
(`stage.py`) decides when: this module decides what.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, NamedTuple

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.control import parse_event
from trace_proxy.capture.dialects import DIALECTS, PROMPT_IDS, ParsedCall, ParseError
from trace_proxy.capture.dialects.common import (
    decode_request,
    exchange_failure,
    new_call,
    stream_failure,
    weight_version_header,
)
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.routes import RouteKind, classify
from trace_proxy.capture.sessions import ended_session
from trace_proxy.logtext import printable
from trace_proxy.metrics import Metrics, children
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.ledger import Ledger
from trace_proxy.trajectories.record import GenerateCall, ToolCall

log = logging.getLogger(__name__)


class Parsed(NamedTuple):
    """A generate exchange's calls, each with its key hints and the JSON text of its prompt
    ids, if known."""

    dialect: str
    calls: list[tuple[KeyHints, GenerateCall, bytes | None]]


class Dispatcher:
    """Records exchanges, one at a time, in the order the stage hands them over."""

    def __init__(
        self,
        resolver: MetadataResolver,
        assembler: Assembler,
        metrics: Metrics,
        ledger: Ledger,
        *,
        project: str,
        experiment: str,
    ) -> None:
        self._resolver = resolver
        self._assembler = assembler
        self._metrics = metrics
        self._ledger = ledger
        self._recorded_calls = children(metrics.calls_recorded)
        self._unparsed_calls = children(metrics.calls_unparsed)
        self._tool_calls = children(metrics.tool_calls_recorded)
        self._project = project
        self._experiment = experiment

    def process(self, exchange: Exchange, parsed: Parsed | None = None) -> None:
        """Parse and record one exchange (`parsed`: its calls, when already parsed)."""
        kind = classify(exchange.method, exchange.path)
        if kind is RouteKind.SESSION_END:  # needs no body: kept or dropped, the session ends
            if exchange.dropped is None:
                self._ledger.made(0)  # nothing of its own is recorded
            self._end_session(exchange)
            return
        if exchange.dropped is not None:
            if kind is RouteKind.GENERATE or exchange.tool_route is not None:
                hints = self._resolver.resolve(
                    exchange.request_headers, exchange.path_metadata, None
                )
                self._assembler.add_dropped(hints, exchange.start, exchange.end, exchange.admitted)
            return
        if kind is RouteKind.CONTROL:
            hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, None)
            event = parse_event(
                exchange,
                project=hints.values.get("project", self._project),
                experiment=hints.values.get("experiment", self._experiment),
            )
            self._metrics.events_recorded.labels(event.event).inc()
            self._assembler.add_event(event)
            return
        if exchange.tool_route is not None:
            self._tool_call(exchange)
            return
        if kind is not RouteKind.GENERATE:
            self._ledger.made(0)
            return
        if exchange.bodies_skipped is not None:
            self._add_unparsed(exchange, DIALECTS[exchange.path][0], exchange.bodies_skipped)
            return
        self._add_calls(exchange, parsed or self.parse(exchange))

    def parse(self, exchange: Exchange) -> Parsed:
        """A generate exchange's calls, each with its key hints and the JSON text of its
        prompt ids (see `decode_request`); what cannot be parsed, as an unparsed call."""
        dialect, parser = DIALECTS[exchange.path]
        request: Any = None
        ids_text: bytes | None = None
        resolved: dict[int, KeyHints] = {}  # by id() of the body resolved
        try:
            ids_field = PROMPT_IDS.get(exchange.path)
            request, ids_text = decode_request(
                exchange.request_body, ids_field, partial(self._latest_prompt, exchange, resolved)
            )
            if not isinstance(request, dict):
                raise ParseError("request body is not a JSON object")
            parsed = parser(exchange, request)
        except (orjson.JSONDecodeError, ParseError) as exc:
            parsed = [self._unparsed(exchange, dialect, request, _reason(exc))]
        except Exception as exc:  # a parser bug must not lose the call
            log.exception("parser %s failed on %s", dialect, printable(exchange.path))
            parsed = [self._unparsed(exchange, dialect, request, f"parser error: {exc!r}")]
        ids = request.get(ids_field) if ids_text is not None and ids_field else None
        version = weight_version_header(exchange.request_headers)
        calls = []
        for item in parsed:
            if item.call.weight_version is None:  # the server's own report wins
                item.call.weight_version = version
            found = resolved.get(id(item.body))
            hints = found or self._resolver.resolve(
                exchange.request_headers, exchange.path_metadata, item.body
            )
            # The text goes with the call whose prompt is that very list.
            text = ids_text if ids is not None and item.call.prompt.token_ids is ids else None
            calls.append((hints, item.call, text))
        return Parsed(dialect, calls)

    def _add_calls(self, exchange: Exchange, parsed: Parsed) -> None:
        self._ledger.made(len(parsed.calls))
        for hints, call, text in parsed.calls:
            counter = self._unparsed_calls if call.unparsed else self._recorded_calls
            counter(parsed.dialect).inc()
            self._assembler.add_call(hints, call, admitted=exchange.admitted, ids_text=text)

    def _add_unparsed(self, exchange: Exchange, dialect: str, reason: str) -> None:
        item = self._unparsed(exchange, dialect, None, reason)
        hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, None)
        self._unparsed_calls(dialect).inc()
        self._assembler.add_call(hints, item.call, admitted=exchange.admitted)

    def _latest_prompt(
        self, exchange: Exchange, resolved: dict[int, KeyHints], request: dict[str, Any]
    ) -> tuple[bytes, int] | None:
        """Resolved once: the request's calls reuse these hints. Body rules read only strings
        and ints, so the ids the request still lacks here change nothing."""
        hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, request)
        resolved[id(request)] = hints
        return self._assembler.latest_prompt(hints)

    def _end_session(self, exchange: Exchange) -> None:
        """The trajectory the session's calls were mapped to is done (see sessions.py): the
        key is resolved from the request as if its calls' session header carried the id."""
        ended = ended_session(exchange.path, exchange.query)
        if ended is None:
            return
        header, session = ended
        headers = CIMultiDict(exchange.request_headers)
        headers[header] = session
        hints = self._resolver.resolve(CIMultiDictProxy(headers), exchange.path_metadata, None)
        self._assembler.end(hints)

    def _tool_call(self, exchange: Exchange) -> None:
        tool = ToolCall(
            index=-1,
            observed="http_tool_server",
            start=exchange.start,
            end=exchange.end,
            name=exchange.tool_route,
            arguments=_text(exchange.request_body, exchange.bodies_skipped),
            result=_text(exchange.response_body, exchange.bodies_skipped),
            error=exchange_failure(exchange),
            route=exchange.path,
            upstream=exchange.upstream,
            http_status=exchange.status,
        )
        hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, None)
        self._tool_calls(exchange.tool_route or "").inc()
        self._assembler.add_tool(hints, tool)

    @staticmethod
    def _unparsed(exchange: Exchange, dialect: str, request: Any, reason: str) -> ParsedCall:
        body = request if isinstance(request, dict) else {}
        call = new_call(exchange, dialect, {})
        call.stream = bool(body.get("stream"))
        call.unparsed = reason
        call.error = exchange_failure(exchange) or stream_failure(exchange)
        return ParsedCall(call, body)


MAX_TOOL_TEXT = 1 << 20


def _text(body: bytes, skipped: str | None = None) -> str | None:
    """A tool server's body as text, capped: tool outputs can be whole files."""
    if skipped is not None:
        return f"[{skipped}]"
    if not body:
        return None
    text = body[:MAX_TOOL_TEXT].decode("utf-8", "replace")
    return text if len(body) <= MAX_TOOL_TEXT else text + f"... [{len(body)} bytes in all]"


def _reason(exc: Exception) -> str:
    if isinstance(exc, orjson.JSONDecodeError):
        return f"request is not JSON: {exc}"
    return str(exc)
