"""A trajectory as an MLflow trace: its info (tags, metadata, previews) and its spans, built from
the trajectory's span view (`spans.py`). Pure: no MLflow call; the exporter (`mlflow.py`)
writes what is built here."""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson
from mlflow.entities import (
    Span,
    SpanType,
)

from trace_proxy.exporters.backends.mlflow_names import (
    label_tag,
)
from trace_proxy.exporters.backends.spans import (
    ROOT_NAME,
    Generation,
    Tool,
    TrajectorySpans,
    trajectory_spans,
)
from trace_proxy.trajectories.record import Trajectory, dumps

PREVIEW_CHARS = 1000  # MLflow's own request/response preview length
HEX32 = re.compile(r"[0-9a-f]{32}")


def _ns(seconds: float) -> int:
    """A record's time (epoch seconds) in ns, to the whole microsecond: MLflow's spans have
    always been drawn so (the other backends keep the float's exact value, `spans.ns`)."""
    return round(seconds * 1_000_000) * 1_000


def trace_id_of(record_id: str) -> str:
    """The MLflow trace id of a trajectory record: `tr-<record id>` (hashed if not 32 hex)."""
    if HEX32.fullmatch(record_id) is None:
        record_id = hashlib.blake2b(record_id.encode(), digest_size=16).hexdigest()
    return "tr-" + record_id


def _span_id(trace_id: str, part: str) -> bytes:
    digest = hashlib.blake2b(f"{trace_id}/{part}".encode(), digest_size=8).digest()
    return digest if any(digest) else b"\x00" * 7 + b"\x01"  # an all-zero id is invalid


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def _compact(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _preview(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else _json(value)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


@dataclass
class _SpanData:
    name: str
    span_type: str
    part: str  # what the span id is derived from
    root: bool  # else a child of the root
    start: float
    end: float | None
    inputs: Any
    outputs: Any
    attributes: dict[str, Any]
    error: dict[str, Any] | None = None  # the record's error, as an attribute

    @property
    def status_message(self) -> str | None:
        """None: status OK; else status ERROR with this description."""
        if self.error is None:
            return None
        if self.root:
            return str(self.error.get("message"))
        return f"{self.error.get('type')}: {self.error.get('message')}"


@dataclass
class TraceRecord:
    """A trajectory rendered for MLflow: the trace info fields and the spans."""

    trace_id: str
    info_tags: dict[str, str]
    metadata: dict[str, str]
    request_preview: str | None
    response_preview: str | None
    start_ns: int
    end_ns: int
    error: bool
    spans: list[_SpanData]
    record_id: str


# --- rendering a trajectory (pure functions of its JSON form) ---------------------------------


def _llm_inputs(call: Generation, prompt_ids: list[int] | None) -> dict[str, Any]:
    prompt = call.prompt
    inputs = _compact(
        {
            "messages": prompt.get("messages"),
            "tools": prompt.get("tools"),
            "prompt": prompt.get("text"),
            "prompt_ids": prompt_ids,
            "prompt_text": call.prompt_text,
        }
    )
    if call.prompt_text is None and call.prompt_piece is not None:
        # The whole prompt could not be decoded from the pieces: the decoded new part only.
        inputs["prompt_suffix_text"] = call.prompt_piece
    inputs["sampling_params"] = call.sampling or {}
    return inputs


def _llm_outputs(call: Generation) -> dict[str, Any]:
    chat = call.declared.chat
    choices = []
    for out in call.outputs:
        choice: dict[str, Any] = {"index": out.get("index")}
        if chat:
            choice["message"] = {
                "role": "assistant",
                "content": out.get("text"),
                **_compact(
                    {
                        "tool_calls": out.get("tool_calls"),
                        "reasoning_content": out.get("reasoning"),
                    }
                ),
            }
        else:
            choice["text"] = out.get("text")
        choice.update(
            _compact(
                {
                    "token_ids": out.get("token_ids"),
                    "response_text": out.get("response_text"),
                    "finish_reason": out.get("finish_reason"),
                    "stop_reason": out.get("stop_reason"),
                }
            )
        )
        choices.append(choice)
    return _compact(
        {
            "id": call.request_id,
            "model": call.model,
            "choices": choices,
            "usage": call.usage,
            "error": call.error,
            "unparsed": call.unparsed,
        }
    )


def _token_usage(usage: Any) -> dict[str, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": total if isinstance(total, int) else prompt + completion,
    }


def _tool_inputs(tool: Tool) -> Any:
    if tool.arguments is None:
        return None
    parsed = tool.parsed_arguments
    return parsed if isinstance(parsed, dict) else {"arguments": tool.arguments}


def _last_user_text(messages: Any) -> Any:
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return message.get("content")
    return messages


def _root_error(spans: TrajectorySpans) -> dict[str, Any]:
    failed = spans.failed
    if not failed:
        return {"type": "error", "message": "trajectory status is error"}
    first, error = failed[0], failed[0].error or {}
    return {
        "type": "calls_failed",
        "message": f"{len(failed)} of {len(spans.calls)} calls failed; call {first.index}: "
        f"{error.get('type')}: {error.get('message')}",
    }


def _tag_value(value: Any) -> str:
    return value if isinstance(value, str) else _json(value)


def outcome_tags(reward: Any, score: Any, labels: Any) -> dict[str, str]:
    """Trace tags for a trajectory's reward, score and labels (`label.<name>`)."""
    tags = {}
    if reward is not None:
        tags["reward"] = _tag_value(reward)
    if score is not None:
        tags["score"] = _tag_value(score)
    for name, value in (labels or {}).items():
        tags[label_tag(name)] = _tag_value(value)
    return tags


def render(trajectory: Trajectory, run_id: str | None) -> TraceRecord:
    """The trace of one trajectory (pure: no MLflow calls)."""
    view = trajectory_spans(orjson.loads(dumps(trajectory)))
    root = view.root
    key = root.key
    trace_id = trace_id_of(root.record_id)

    prompt_ids = view.prompt_ids()
    spans: list[_SpanData] = []
    for call, ids in zip(view.calls, prompt_ids, strict=True):
        attributes = _compact(
            {
                "mlflow.llm.model": call.model,
                "mlflow.chat.tokenUsage": _token_usage(call.usage),
                "mlflow.chat.tools": call.prompt.get("tools"),
                "index": call.index,
                "dialect": call.dialect,
                "route": call.route,
                "upstream": call.upstream,
                "http_status": call.http_status,
                "stream": call.stream,
                "request_id": call.request_id,
                "first_byte_ns": _ns(call.first_byte) if call.first_byte else None,
                "weight_version": call.weight_version,
                "version_lag": root.lag_of(call),
                "segments": call.segments,
            }
        )
        spans.append(_SpanData(
            name="generate", span_type=SpanType.LLM, part=call.id, root=False,
            start=call.start, end=call.end, inputs=_llm_inputs(call, ids),
            outputs=_llm_outputs(call), attributes=attributes, error=call.error,
        ))  # fmt: skip
    for tool in view.tools:
        attributes = _compact(
            {
                "index": tool.index,
                "observed": tool.observed,
                "call_id": tool.call_id,
                "requested_by": tool.requested_by,
                "raw": tool.raw,
                "route": tool.route,
                "upstream": tool.upstream,
                "http_status": tool.http_status,
            }
        )
        # A call never answered ends when the trajectory does (its result is unknown).
        spans.append(_SpanData(
            name=tool.name or "tool", span_type=SpanType.TOOL, part=tool.id, root=False,
            start=tool.start, end=tool.end if tool.end is not None else root.end,
            inputs=_tool_inputs(tool), outputs=tool.result, attributes=attributes,
            error=tool.error,
        ))  # fmt: skip

    first_prompt = view.calls[0].prompt if view.calls else {}
    root_inputs = _compact(
        {
            "messages": first_prompt.get("messages"),
            "prompt": first_prompt.get("text"),
            "prompt_ids": prompt_ids[0] if prompt_ids else None,
            "prompt_text": view.calls[0].prompt_text if view.calls else None,
        }
    )
    last = (view.calls[-1].outputs or [{}])[0] if view.calls else {}
    response = last.get("text") if last.get("text") is not None else last.get("response_text")
    if response is None and last.get("tool_calls"):
        response = last.get("tool_calls")
    root_outputs = _compact(
        {
            "response": response,
            "transcript": root.transcript,
            "reward": root.reward,
            "score": root.score,
            "labels": root.labels or None,
            "num_turns": len(view.calls),
            "status": root.status,
            "close_reason": root.close_reason,
        }
    )
    root_attributes = _compact(
        {
            "trajectory_record_id": root.record_id,
            "project": key.get("project"),
            "experiment": key.get("experiment"),
            "step": key.get("step"),
            "sample_index": key.get("sample_index"),
            "rollout_n": key.get("rollout_n"),
            "validate": key.get("validate"),
            "trajectory_id": key.get("trajectory_id"),
            "sample_hash": key.get("sample_hash"),
            "key_sources": key.get("sources") or None,
            "part": root.part,
            "upstreams": root.upstreams or None,
            "weight_versions": root.weight_versions or None,
            **root.policy_fields(),
            "annotations": root.annotations or None,
            "summary": root.summary or None,
        }
    )
    error = root.status == "error"
    spans.insert(0, _SpanData(
        name=ROOT_NAME, span_type=SpanType.AGENT, part=root.id, root=True,
        start=root.start, end=root.end, inputs=root_inputs, outputs=root_outputs,
        attributes=root_attributes, error=_root_error(view) if error else None,
    ))  # fmt: skip

    # verl's tags, as verl writes them (str() of the value), so the same filters work.
    tags = {"mlflow.traceName": ROOT_NAME}
    for name in ("step", "sample_index", "rollout_n"):
        if key.get(name) is not None:
            tags[name] = str(key[name])
    tags["validate"] = str(bool(key.get("validate")))
    tags["experiment_name"] = str(key.get("experiment"))
    if key.get("trajectory_id") is not None:
        tags["trajectory_id"] = str(key["trajectory_id"])
    tags.update(outcome_tags(root.reward, root.score, root.labels))

    metadata = {"mlflow.trace_schema.version": "3", "trace_proxy.record_id": root.record_id}
    if run_id is not None:
        metadata["mlflow.sourceRun"] = run_id
    usage = [u for u in (_token_usage(c.usage) for c in view.calls) if u is not None]
    if usage:
        totals = {k: sum(u[k] for u in usage) for k in usage[0]}
        metadata["mlflow.trace.tokenUsage"] = _json(totals)

    messages = first_prompt.get("messages")
    request = _last_user_text(messages) if messages else None
    if request is None:
        request = first_prompt.get("text") or root_inputs.get("prompt_text")
    return TraceRecord(
        trace_id=trace_id,
        info_tags=tags,
        metadata=metadata,
        request_preview=_preview(request),
        response_preview=_preview(response),
        start_ns=_ns(root.start),
        end_ns=_ns(root.end),
        error=error,
        spans=spans,
        record_id=root.record_id,
    )  # fmt: skip


def to_mlflow_spans(
    trace: TraceRecord, experiment_id: str, *, tags_on_root: bool = False
) -> list[Span]:
    """MLflow span entities; `tags_on_root`: the trace tags also as root attributes
    `mlflow.traceTag.<k>`, for a server that creates the trace from its spans (OTLP)."""
    otel_trace_id = _b64(bytes.fromhex(trace.trace_id.removeprefix("tr-")))
    request_id = _json(trace.trace_id)
    spans = []
    for span in trace.spans:
        start = _ns(span.start)
        end = max(start, _ns(span.end)) if span.end is not None else start
        attributes = {
            "mlflow.traceRequestId": request_id,
            "mlflow.spanType": _json(span.span_type),
            "mlflow.spanInputs": _json(span.inputs),
            "mlflow.spanOutputs": _json(span.outputs),
            **{k: _json(v) for k, v in span.attributes.items()},
        }
        if span.root:
            attributes["mlflow.experimentId"] = _json(experiment_id)
            if tags_on_root:
                for name, value in trace.info_tags.items():
                    attributes["mlflow.traceTag." + name] = _json(value)
        if span.error is not None:
            attributes["error"] = _json(span.error)
        message = span.status_message
        status = (
            {"code": "STATUS_CODE_OK", "message": ""}
            if message is None
            else {"code": "STATUS_CODE_ERROR", "message": message}
        )
        parent = None if span.root else _span_id(trace.trace_id, "root")
        spans.append(Span.from_dict({
            "trace_id": otel_trace_id,
            "span_id": _b64(_span_id(trace.trace_id, span.part)),
            "parent_span_id": _b64(parent) if parent is not None else None,
            "name": span.name,
            "start_time_unix_nano": start,
            "end_time_unix_nano": end,
            "events": [],
            "status": status,
            "attributes": attributes,
        }))  # fmt: skip
    return spans


# --- the exporter ------------------------------------------------------------------------------
