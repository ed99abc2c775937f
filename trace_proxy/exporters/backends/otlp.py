"""The otlp backend: every trajectory as one OpenTelemetry trace, sent over OTLP/HTTP.

Why: OTLP is the one wire format that every trace UI takes in (MLflow `/v1/traces`, Langfuse,
Phoenix, Jaeger, any OpenTelemetry Collector), so one exporter reaches them all, and the spans
follow the GenAI semantic conventions those UIs already render.

How a trajectory is drawn (names are string literals: the conventions are "Development" and
their Python constants are deprecated):
    invoke_agent agent_loop            the rollout, from its first start to its last end
      chat {model}                     one per generate call of the `openai.chat` dialect
      text_completion {model}          one per generate call of any other dialect
      execute_tool {name}              one per tool span, linked to the call that asked for it
The spans are mapped from the trajectory's neutral view (`spans.py`); their messages and
attributes are the conventions' (`otlp_conventions.py`). Every span carries the
exact start and end times of the record (Unix seconds as floats, turned into integer
nanoseconds without float error: `spans.ns`). A call's `gen_ai.input.messages` is its full
prompt (prefix sharing undone; for token dialects the decoded text that token2text stored),
`gen_ai.output.messages` its outputs, both JSON in the conventions' parts format. The rollout
key sits on the root twice: as `rollout.*` attributes, and as `mlflow.traceTag.<field>`
strings, which MLflow's OTLP ingestion turns into trace tags, so `tags.step = '1'` finds a
step. Errors become span status ERROR with the message.
A `StepEvent` becomes a zero-length span `step_event {event}` in a trace of its own; step
summaries and annotations are skipped (a late reward cannot change a trace already sent: it
stays in the jsonl store).

Ids: a trace's id is its record's id (a uuid4 hex, 128 bits, as OTLP wants), so a trace is found
by record id; span ids are hashed from it, so a retried export sends the very same spans.

Delivery: a TracerProvider of our own (never the global one; sampler ALWAYS_ON, whatever the
environment says) whose one processor keeps the ended spans; `export()` hands them to the
SpanExporter itself, one request per `request_budget` characters of content, and raises when the
SpanExporter reports failure, so the pipeline retries; a refusal that no retry can change (400,
413, 422, seen on our own `requests` session) raises `ExportRejected`, so those records are
dropped and counted instead of holding up every record behind them. The SDK's processors
cannot tell: in SDK 1.45 `SimpleSpanProcessor` drops the export result and
`BatchSpanProcessor.force_flush()` returns True after a failed export, so a 503 would be lost
silently. Nothing is buffered between calls:
when `export()` returns, the spans were accepted. Records already accepted in a batch that then
failed are not sent again by its retry. `OTLPSpanExporter` itself retries 429/502/503/504 and
connection errors with backoff (or the receiver's Retry-After) while that fits in its timeout
(10 s, `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`) before it reports failure.

Cost: the span view (the record's fields read where they are), one orjson dump per message
list, and the SDK's span objects; a call's full prompt is re-sent on every call (the
conventions want the whole input per call), so content grows with turns x context, which is
why requests are split.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from trace_proxy import __version__
from trace_proxy.exporters.backends.otlp_conventions import (
    RL_VERSION,
    Attributes,
    CallView,
    content_size,
    describe,
    fill_messages,
    int_or_none,
    json_text,
    providers_of,
    put,
    root_attributes,
    root_error,
    segment_event,
    span_attributes_of_tool,
)
from trace_proxy.exporters.backends.spans import (
    ROOT_NAME,
    error_text,
    ns,
    trajectory_spans,
)
from trace_proxy.exporters.base import Exporter, ExportRejected
from trace_proxy.trajectories.record import Record, StepEvent, Trajectory, dumps

log = logging.getLogger(__name__)

SCOPE = "trace_proxy.exporters.otlp"
REQUEST_BUDGET = 8_000_000  # characters of content per OTLP request (the receiver caps bytes)


# The receiver cannot take these spans, however often they are sent (bad request, too large,
# invalid): the records are rejected (the pipeline finds which, drops and counts them). Any
# other refusal (401, 404: a setting to fix; 5xx: a receiver in trouble) is retried.
REJECTED_STATUSES = (400, 413, 422)


class OtlpExportError(RuntimeError):
    """The receiver did not accept a request (the pipeline retries the batch)."""


class OtlpExporter(Exporter):
    name = "otlp"
    request_budget = REQUEST_BUDGET

    def __init__(
        self,
        endpoint: str,
        headers: dict[str, str],
        *,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self._status: int | None = None  # of the receiver's latest answer, when known
        if span_exporter is None:
            import requests
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # The SDK only says "failure": the status, seen on the way, tells which kind.
            session = requests.Session()
            session.hooks["response"].append(self._answered)
            span_exporter = OTLPSpanExporter(
                endpoint=endpoint, headers=dict(headers), session=session
            )
        self.endpoint = endpoint
        self._exporter = span_exporter
        self._ids = _RecordIds()
        self._ended = _Keep()
        self._provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource.create({"service.name": "trace-proxy"}),
            id_generator=self._ids,
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(self._ended)
        self._tracer = self._provider.get_tracer(SCOPE, __version__)
        self._lock = threading.Lock()
        self._accepted: set[str] = set()  # records of a failing batch that already went out
        self._closed = False

    def export(self, records: list[Record]) -> None:
        with self._lock:
            spans: list[ReadableSpan] = []
            keys: list[str] = []
            size = 0
            for record in records:
                key = _record_key(record)
                if key is None or key in self._accepted:
                    continue
                try:
                    cost = self._render(record, key)
                except Exception:
                    # A record we cannot draw would fail every retry of the whole batch.
                    log.exception("otlp: record %s could not be converted; skipped", key)
                    continue
                finally:
                    drawn = self._ended.take()
                if spans and size + cost > self.request_budget:
                    self._send(spans, keys)
                    spans, keys, size = [], [], 0
                spans += drawn
                keys.append(key)
                size += cost
            if spans:
                self._send(spans, keys)
            self._accepted.clear()  # the whole batch went out: a retry of it will not come

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._provider.shutdown()
            finally:
                self._exporter.shutdown()

    def _answered(self, response: Any, *args: Any, **kwargs: Any) -> None:
        self._status = response.status_code

    def _send(self, spans: list[ReadableSpan], keys: list[str]) -> None:
        self._status = None
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS and self._status in REJECTED_STATUSES:
            raise ExportRejected(
                f"otlp: {self.endpoint} refused {len(spans)} spans ({len(keys)} records) for "
                f"good (HTTP {self._status})"
            )
        if result is not SpanExportResult.SUCCESS:
            raise OtlpExportError(
                f"OTLP export of {len(spans)} spans ({len(keys)} records) to {self.endpoint} "
                "failed (see the opentelemetry exporter's log for the reason)"
            )
        self._accepted.update(keys)

    def _render(self, record: Record, key: str) -> int:
        """Draw the record's spans (kept by `self._ended`); returns their content size."""
        self._ids.reset(_trace_id(key))
        if isinstance(record, Trajectory):
            return self._trajectory(record)
        assert isinstance(record, StepEvent)
        return self._event(record)

    def _trajectory(self, t: Trajectory) -> int:
        view = trajectory_spans(t)
        top = view.root
        conversation = top.key.get("trajectory_id") or top.record_id
        providers = providers_of(view.calls)
        calls = [CallView(c, providers, conversation, top.lag_of(c)) for c in view.calls]
        fill_messages(view, calls)
        start = min([top.start, *(c.start for c in view.calls), *(s.start for s in view.tools)])
        ends = [top.end, *(c.end or 0.0 for c in view.calls), *(s.end or 0.0 for s in view.tools)]
        end = max(ends)

        attributes = root_attributes(view, conversation, calls)
        root = self._tracer.start_span(
            f"invoke_agent {ROOT_NAME}",
            context=Context(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=ns(start),
        )
        failed = view.failed
        if top.status == "error" or failed:
            root.set_status(Status(StatusCode.ERROR, root_error(failed, len(calls))))
        parent = trace.set_span_in_context(root)
        size = 500 + content_size(attributes)

        contexts: list[trace.SpanContext] = []
        for call_view in calls:
            call = call_view.call
            call_attributes = call_view.attributes()
            operation = call_view.operation
            span = self._tracer.start_span(
                f"{operation} {call.model}" if call.model else operation,
                context=parent,
                kind=SpanKind.CLIENT,
                attributes=call_attributes,
                start_time=ns(call.start),
            )
            if call.first_byte is not None:
                span.add_event("first_byte", timestamp=ns(call.first_byte))
            for segment in call.segments or []:
                segment_event(span, segment)
            if call.error is not None:
                span.set_status(Status(StatusCode.ERROR, error_text(call.error)))
            contexts.append(span.get_span_context())
            span.end(end_time=ns(call.end if call.end is not None else call.start))
            size += 300 + content_size(call_attributes)

        for tool in view.tools:
            tool_attrs = span_attributes_of_tool(tool, conversation)
            requested_by = tool.requested_by
            links = (
                [Link(contexts[requested_by])]
                if requested_by is not None and 0 <= requested_by < len(contexts)
                else None
            )
            span = self._tracer.start_span(
                f"execute_tool {tool.name}" if tool.name else "execute_tool",
                context=parent,
                kind=SpanKind.INTERNAL,
                attributes=tool_attrs,
                links=links,
                start_time=ns(tool.start),
            )
            if tool.error is not None:
                span.set_status(Status(StatusCode.ERROR, error_text(tool.error)))
            span.end(end_time=ns(tool.end if tool.end is not None else max(tool.start, end)))
            size += 300 + content_size(tool_attrs)

        root.end(end_time=ns(end))
        return size

    def _event(self, event: StepEvent) -> int:
        attributes: Attributes = {
            "trace_proxy.event": event.event,
            "trace_proxy.route": event.route,
            "trace_proxy.upstream": event.upstream,
            "rollout.project": event.project,
            "rollout.experiment": event.experiment,
            "mlflow.traceTag.project": event.project,
            "mlflow.traceTag.experiment": event.experiment,
            "mlflow.traceTag.event": event.event,
        }
        put(attributes, "http.response.status_code", int_or_none(event.http_status))
        put(attributes, "rollout.weight_version", event.weight_version)
        put(attributes, RL_VERSION, event.weight_version)
        if event.params:
            attributes["trace_proxy.params"] = json_text(event.params)
        span = self._tracer.start_span(
            f"step_event {event.event}",
            context=Context(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=ns(event.time),
        )
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, describe(event.error)))
        span.end(end_time=ns(event.time))
        return 300 + content_size(attributes)


@dataclass(frozen=True)
class OtlpConfig:
    """What the otlp backend is told: `--otlp-endpoint`, and the `--otlp-header` items
    (`NAME=VALUE`, checked by `create`)."""

    endpoint: str
    headers: tuple[str, ...] = ()


def create(config: OtlpConfig) -> OtlpExporter:
    return OtlpExporter(config.endpoint, parse_headers(config.headers))


def parse_headers(items: Iterable[str]) -> dict[str, str]:
    """`NAME=VALUE` items (the value may hold `=`, as base64 does) as a header dict."""
    headers: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"OTLP header {item!r} is not NAME=VALUE")
        headers[name.strip()] = value.strip()
    return headers


class _Keep(SpanProcessor):
    """Keeps ended spans until `export()` takes them (one thread draws and takes)."""

    def __init__(self) -> None:
        self._spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)

    def take(self) -> list[ReadableSpan]:
        spans, self._spans = self._spans, []
        return spans


class _RecordIds(IdGenerator):
    """The record's trace id, and span ids hashed from it in drawing order."""

    def __init__(self) -> None:
        self._trace_id = 1
        self._seed = b""
        self._count = 0

    def reset(self, trace_id: int) -> None:
        self._trace_id = trace_id
        self._seed = trace_id.to_bytes(16, "big")
        self._count = 0

    def generate_trace_id(self) -> int:
        return self._trace_id

    def generate_span_id(self) -> int:
        self._count += 1
        digest = hashlib.blake2b(self._seed + self._count.to_bytes(4, "big"), digest_size=8)
        return int.from_bytes(digest.digest(), "big") or 1


def _record_key(record: Record) -> str | None:
    if isinstance(record, Trajectory):
        return record.id
    if isinstance(record, StepEvent):
        return "event:" + hashlib.blake2b(dumps(record), digest_size=16).hexdigest()
    return None  # step summaries and annotations are not traces


def _trace_id(key: str) -> int:
    """A uuid hex record id as it is; anything else hashed to 128 bits."""
    if len(key) == 32:
        try:
            value = int(key, 16)
        except ValueError:
            value = 0
        if value:
            return value
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "big") or 1
