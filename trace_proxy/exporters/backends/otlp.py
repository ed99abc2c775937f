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
The spans are mapped from the trajectory's neutral view (`spans.py`). Every span carries the
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from trace_proxy import __version__
from trace_proxy.exporters.backends.spans import (
    Generation,
    Tool,
    TrajectorySpans,
    error_text,
    ns,
    trajectory_spans,
)
from trace_proxy.exporters.base import ExportRejected
from trace_proxy.trajectories.record import CallError, Record, StepEvent, Trajectory, dumps

log = logging.getLogger(__name__)

AGENT_NAME = "agent_loop"
SCOPE = "trace_proxy.exporters.otlp"
REQUEST_BUDGET = 8_000_000  # characters of content per OTLP request (the receiver caps bytes)
PROVIDERS = {"vllm.generate": "vllm", "sglang.generate": "sglang"}
# key field -> root attribute; the MLflow trace tag is `mlflow.traceTag.<key field>`
KEY_ATTRIBUTES = {
    "project": "rollout.project",
    "experiment": "rollout.experiment",
    "step": "rollout.step",
    "sample_index": "rollout.sample_index",
    "rollout_n": "rollout.n",
    "validate": "rollout.validate",
    "trajectory_id": "rollout.trajectory_id",
    "sample_hash": "rollout.sample_hash",
}
SAMPLING_FLOATS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")

Attributes = dict[str, Any]


# The receiver cannot take these spans, however often they are sent (bad request, too large,
# invalid): the records are rejected (the pipeline finds which, drops and counts them). Any
# other refusal (401, 404: a setting to fix; 5xx: a receiver in trouble) is retried.
REJECTED_STATUSES = (400, 413, 422)


class OtlpExportError(RuntimeError):
    """The receiver did not accept a request (the pipeline retries the batch)."""


class OtlpExporter:
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
        providers = _providers(view.calls)
        calls = [_CallView(call, providers, conversation) for call in view.calls]
        _fill_messages(view, calls)
        start = min([top.start, *(c.start for c in view.calls), *(s.start for s in view.tools)])
        ends = [top.end, *(c.end or 0.0 for c in view.calls), *(s.end or 0.0 for s in view.tools)]
        end = max(ends)

        attributes = _root_attributes(view, conversation, calls)
        root = self._tracer.start_span(
            f"invoke_agent {AGENT_NAME}",
            context=Context(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=ns(start),
        )
        failed = view.failed
        if top.status == "error" or failed:
            root.set_status(Status(StatusCode.ERROR, _root_error(failed, len(calls))))
        parent = trace.set_span_in_context(root)
        size = 500 + _content_size(attributes)

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
                _segment_event(span, segment)
            if call.error is not None:
                span.set_status(Status(StatusCode.ERROR, error_text(call.error)))
            contexts.append(span.get_span_context())
            span.end(end_time=ns(call.end if call.end is not None else call.start))
            size += 300 + _content_size(call_attributes)

        for tool in view.tools:
            tool_attributes = _tool_attributes(tool, conversation)
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
                attributes=tool_attributes,
                links=links,
                start_time=ns(tool.start),
            )
            if tool.error is not None:
                span.set_status(Status(StatusCode.ERROR, error_text(tool.error)))
            span.end(end_time=ns(tool.end if tool.end is not None else max(tool.start, end)))
            size += 300 + _content_size(tool_attributes)

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
        _put(attributes, "http.response.status_code", _int(event.http_status))
        _put(attributes, "rollout.weight_version", event.weight_version)
        if event.params:
            attributes["trace_proxy.params"] = _json(event.params)
        span = self._tracer.start_span(
            f"step_event {event.event}",
            context=Context(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=ns(event.time),
        )
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, _describe(event.error)))
        span.end(end_time=ns(event.time))
        return 300 + _content_size(attributes)


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


class _CallView:
    """One generate call, with its full input and output rendered as convention messages."""

    __slots__ = ("call", "conversation", "input_messages", "operation", "output_messages",
                 "prompt_note", "provider", "tool_definitions")  # fmt: skip

    def __init__(self, call: Generation, providers: dict[str, str], conversation: str) -> None:
        self.call = call
        self.conversation = conversation
        self.operation = "chat" if call.dialect == "openai.chat" else "text_completion"
        self.provider = PROVIDERS.get(call.dialect or "") or providers.get(call.upstream or "")
        self.input_messages: str | None = None
        self.output_messages: str | None = None
        self.tool_definitions: str | None = None
        self.prompt_note: Attributes = {}

    def attributes(self) -> Attributes:
        call = self.call
        a: Attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.conversation.id": self.conversation,
            "gen_ai.request.stream": call.stream,
        }
        _put(a, "gen_ai.provider.name", self.provider)
        _put(a, "gen_ai.request.model", call.model)
        _put(a, "gen_ai.response.model", call.model)
        _sampling(a, call.sampling)
        _put(a, "gen_ai.response.id", call.request_id)
        finish = [
            o["finish_reason"] for o in call.outputs if isinstance(o.get("finish_reason"), str)
        ]
        if finish:
            a["gen_ai.response.finish_reasons"] = finish
        _usage(a, call.usage)
        _put(a, "gen_ai.input.messages", self.input_messages)
        _put(a, "gen_ai.output.messages", self.output_messages)
        _put(a, "gen_ai.tool.definitions", self.tool_definitions)
        a.update(self.prompt_note)
        _put(a, "http.response.status_code", _int(call.http_status))
        _server(a, call.upstream)
        a["trace_proxy.call.index"] = call.index
        a["trace_proxy.dialect"] = call.dialect
        a["trace_proxy.route"] = call.route
        a["trace_proxy.upstream"] = call.upstream
        _put(a, "rollout.weight_version", call.weight_version)
        _put(a, "trace_proxy.unparsed", call.unparsed)
        if call.error is not None:
            a["error.type"] = call.error.get("type")
        return a


def _providers(calls: tuple[Generation, ...]) -> dict[str, str]:
    """Which server each upstream is, as far as a native dialect to it tells."""
    found: dict[str, str] = {}
    for call in calls:
        provider = PROVIDERS.get(call.dialect or "")
        if provider is not None and call.upstream is not None:
            found.setdefault(call.upstream, provider)
    return found


def _fill_messages(view: TrajectorySpans, calls: list[_CallView]) -> None:
    """Full inputs and outputs of every call, as `gen_ai.*.messages` JSON strings."""
    if not calls:
        return
    decoded = _decoded_prompts(view)
    for call_view, text in zip(calls, decoded, strict=True):
        call = call_view.call
        prompt = call.prompt
        if call_view.operation == "chat" and prompt.get("messages") is not None:
            call_view.input_messages = _json([_chat_message(m) for m in prompt["messages"]])
        else:
            full = text if text is not None else prompt.get("text")
            if full is None and call.prompt_piece is not None:
                # Part of the prompt is shared with an earlier call whose decoded text cannot
                # be cut at a token boundary here: send the decoded rest, and say so.
                full = call.prompt_piece
                omitted = (call.stored_prompt.get("prefix_len") or {}).get("token_ids", 0)
                call_view.prompt_note = {
                    "trace_proxy.prompt.prefix_call": call.stored_prompt.get("prefix_call"),
                    "trace_proxy.prompt.omitted_prefix_tokens": omitted,
                }
            if full is not None:
                call_view.input_messages = _json([_text_message("user", full)])
        if prompt.get("tools"):
            call_view.tool_definitions = _json(prompt["tools"])
        outputs = [_output_message(o, call) for o in call.outputs]
        if any(m["parts"] for m in outputs):
            call_view.output_messages = _json(outputs)


def _decoded_prompts(view: TrajectorySpans) -> list[str | None]:
    """Each call's full prompt as token2text decoded it, where the stored pieces spell it out:
    `prompt_text` is the decoded stored suffix; a call that extends the whole context (prompt +
    first response) of the call it shares with prepends that call's full text.

    Stricter than the view's `prompt_text`, which also joins a prompt that kept the earlier
    prompt but not its response; and the last call's text comes from a stored transcript."""
    calls = view.calls
    full: list[str | None] = []
    context: list[int | None] = []  # token count of prompt + first output, per call
    for position, call in enumerate(calls):
        prompt = call.stored_prompt
        token_ids = prompt.get("token_ids")
        ids = len(token_ids) if token_ids is not None else None
        shared = (prompt.get("prefix_len") or {}).get("token_ids")
        ref = prompt.get("prefix_call")
        first = call.outputs[0] if call.outputs else None
        text: str | None = None
        prompt_len: int | None = ids
        if ref is None or shared is None:
            text = call.prompt_piece
        elif 0 <= ref < position:
            prompt_len = None if ids is None else shared + ids
            base = calls[ref].outputs[0] if calls[ref].outputs else None
            response = (
                "" if base is None or not base.get("token_ids") else base.get("response_text")
            )
            if (
                call.prompt_piece is not None
                and full[ref] is not None
                and context[ref] == shared
                and response is not None
            ):
                text = f"{full[ref]}{response}{call.prompt_piece}"
        full.append(text)
        outputs = len(first["token_ids"]) if first is not None and first.get("token_ids") else 0
        context.append(None if prompt_len is None else prompt_len + outputs)
    last = calls[-1] if calls else None
    transcript = view.root.transcript if view.root.transcript_stored else None
    if (
        last is not None
        and transcript is not None
        and last.stored_prompt.get("token_ids") is not None
        and last.prompt_piece is not None
    ):
        # A stored transcript is the last call's whole context decoded in one piece: stored
        # because the pieces do not spell it out (a re-rendered turn, a character split
        # across pieces), so it is the better text of the last call's prompt.
        first = last.outputs[0] if last.outputs else None
        response = (
            first.get("response_text") if first is not None and first.get("token_ids") else ""
        )
        if response is not None and transcript.endswith(response):
            full[-1] = transcript[: len(transcript) - len(response)]
    return full


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message in the conventions' {role, parts} form."""
    role = message.get("role")
    parts: list[dict[str, Any]] = []
    content = message.get("content")
    if role == "tool":
        parts.append(
            {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}
        )
    else:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "content": reasoning})
        parts += _content_parts(content)
        for tool_call in message.get("tool_calls") or []:
            if isinstance(tool_call, Mapping):
                parts.append(_tool_call_part(tool_call))
    result: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name") is not None:
        result["name"] = message["name"]
    return result


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for item in content:
            if isinstance(item, str):
                parts.append({"type": "text", "content": item})
            elif isinstance(item, Mapping) and item.get("type") == "text":
                parts.append({"type": "text", "content": item.get("text")})
            elif isinstance(item, Mapping):
                parts.append(dict(item))  # image_url, input_audio...: a generic part as sent
        return parts
    return [{"type": "text", "content": str(content)}]


def _tool_call_part(tool_call: Mapping[str, Any]) -> dict[str, Any]:
    function = tool_call.get("function")
    function = function if isinstance(function, Mapping) else {}
    return {
        "type": "tool_call",
        "id": tool_call.get("id"),
        "name": function.get("name"),
        "arguments": _json_or_text(function.get("arguments")),
    }


def _text_message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def _output_message(output: Mapping[str, Any], call: Generation) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if output.get("reasoning"):
        parts.append({"type": "reasoning", "content": output["reasoning"]})
    text = output.get("response_text")
    if text is None:
        text = output.get("text")
    if text:
        parts.append({"type": "text", "content": text})
    for tool_call in output.get("tool_calls") or []:
        if isinstance(tool_call, Mapping):
            parts.append(_tool_call_part(tool_call))
    finish = output.get("finish_reason")
    finish = finish if isinstance(finish, str) else None
    return {
        "role": "assistant",
        "parts": parts,
        "finish_reason": finish or ("error" if call.error is not None else ""),
    }


def _root_attributes(
    view: TrajectorySpans, conversation: str, calls: list[_CallView]
) -> Attributes:
    t = view.root
    a: Attributes = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": AGENT_NAME,
        "gen_ai.conversation.id": conversation,
    }
    names = {v.provider for v in calls}
    if len(names) == 1:
        _put(a, "gen_ai.provider.name", names.pop())
    models = {v.call.model for v in calls}
    if len(models) == 1:
        _put(a, "gen_ai.request.model", models.pop())
    if calls:
        _put(a, "gen_ai.input.messages", calls[0].input_messages)
        _put(a, "gen_ai.output.messages", calls[-1].output_messages)
    key = t.key
    tags: dict[str, Any] = {}
    for field, attribute in KEY_ATTRIBUTES.items():
        value = key.get(field)
        if value is not None:
            a[attribute] = value
            tags[field] = value
    a["rollout.record_id"] = t.record_id
    a["rollout.part"] = t.part
    a["rollout.status"] = t.status
    a["rollout.close_reason"] = t.close_reason
    _put(a, "rollout.reward", _float(t.reward))
    _put(a, "rollout.score", _float(t.score))
    if t.labels:
        a["rollout.labels"] = _json(t.labels)
    if key.get("sources"):
        a["rollout.key_sources"] = _json(key["sources"])
    if t.weight_versions:
        a["rollout.weight_versions"] = [str(v) for v in t.weight_versions]
    if t.upstreams:
        a["trace_proxy.upstreams"] = [str(u) for u in t.upstreams]
    if t.annotations:
        a["trace_proxy.annotations"] = _json(t.annotations)
    for name, count in (t.summary or {}).items():
        if isinstance(count, int) and not isinstance(count, bool):
            a[f"trace_proxy.summary.{name}"] = count
    tags.update(record_id=t.record_id, part=t.part, status=t.status, close_reason=t.close_reason)
    if t.reward is not None:
        tags["reward"] = t.reward
    if t.score is not None:
        tags["score"] = t.score
    for field, value in tags.items():
        a[f"mlflow.traceTag.{field}"] = _tag(value)
    return a


def _tool_attributes(tool: Tool, conversation: str) -> Attributes:
    a: Attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.conversation.id": conversation,
        "trace_proxy.tool.index": tool.index,
        "trace_proxy.tool.observed": tool.observed,
    }
    _put(a, "gen_ai.tool.name", tool.name)
    _put(a, "gen_ai.tool.call.id", tool.call_id)
    _put(a, "gen_ai.tool.call.arguments", tool.arguments)
    _put(a, "gen_ai.tool.call.result", tool.result)
    _put(a, "trace_proxy.tool.requested_by", _int(tool.requested_by))
    if tool.end is None:
        a["trace_proxy.tool.unanswered"] = True
    _put(a, "trace_proxy.tool.raw", tool.raw)
    _put(a, "trace_proxy.route", tool.route)
    _put(a, "trace_proxy.upstream", tool.upstream)
    _put(a, "http.response.status_code", _int(tool.http_status))
    if tool.upstream:
        _server(a, tool.upstream)
    if tool.error is not None:
        a["error.type"] = tool.error.get("type")
    return a


def _sampling(a: Attributes, sampling: Mapping[str, Any]) -> None:
    for field, attribute in SAMPLING_FLOATS.items():
        _put(a, attribute, _float(sampling.get(field)))
    for field in MAX_TOKENS_FIELDS:
        value = _int(sampling.get(field))
        if value is not None:
            a["gen_ai.request.max_tokens"] = value
            break
    _put(a, "gen_ai.request.seed", _int(sampling.get("seed")))
    n = _int(sampling.get("n"))
    if n is not None and n != 1:
        a["gen_ai.request.choice.count"] = n
    stop = sampling.get("stop")
    if isinstance(stop, str):
        a["gen_ai.request.stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        a["gen_ai.request.stop_sequences"] = list(stop)


def _usage(a: Attributes, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    _put(a, "gen_ai.usage.input_tokens", _int(usage.get("input_tokens", prompt)))
    _put(a, "gen_ai.usage.output_tokens", _int(usage.get("output_tokens", completion)))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    _put(a, "gen_ai.usage.cache_read.input_tokens", _int(cached or usage.get("cached_tokens")))
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    _put(a, "gen_ai.usage.reasoning.output_tokens", _int(reasoning))


def _server(a: Attributes, upstream: str | None) -> None:
    if not upstream:
        return
    try:
        parts = urlsplit(upstream)
        host, port = parts.hostname, parts.port
    except ValueError:
        return
    _put(a, "server.address", host)
    _put(a, "server.port", port)


def _segment_event(span: trace.Span, segment: Mapping[str, Any]) -> None:
    start = _float(segment.get("start"))
    if start is None:
        return
    attributes: Attributes = {}
    _put(attributes, "gen_ai.response.id", segment.get("request_id"))
    _put(attributes, "http.response.status_code", _int(segment.get("http_status")))
    _put(attributes, "gen_ai.response.finish_reason", segment.get("finish_reason"))
    _put(attributes, "trace_proxy.segment.end_ns", _maybe_ns(_float(segment.get("end"))))
    span.add_event("segment", attributes=attributes, timestamp=ns(start))


def _root_error(failed: list[Generation], calls: int) -> str:
    if not failed:
        return "trajectory status is error"
    first = error_text(failed[0].error) or "error"
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"{len(failed)} of {calls} calls failed; call {failed[0].index}: {first}{more}"


def _describe(error: CallError) -> str:
    return f"{error.type}: {error.message}"


def _put(a: Attributes, name: str, value: Any) -> None:
    if value is not None:
        a[name] = value


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _maybe_ns(seconds: float | None) -> int | None:
    return None if seconds is None else ns(seconds)


def _tag(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _content_size(attributes: Attributes) -> int:
    return sum(len(v) for v in attributes.values() if isinstance(v, str))
