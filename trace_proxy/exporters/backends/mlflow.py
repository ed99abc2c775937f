"""MLflow backend: one trace per trajectory, in the project's experiment, linked to a run.

A trajectory becomes a trace whose root span `agent_loop` (AGENT) has one child per generate
call (LLM) and per tool call (TOOL), with the record's exact start and end times. The trace
carries verl's string tags (`step`, `sample_index`, `rollout_n`, `validate`,
`experiment_name`, so `tags.step = '1'` finds the same traces as verl's own tracing), plus
`trajectory_id`, `reward`, `score` and `label.<name>` when known, and it is linked to a training
run: `mlflow.sourceRun` metadata and `link_traces_to_run`. A reward that arrives after its
trajectory was exported (an annotation) is set as tags on the trace.

Writes are synchronous, from the export worker thread, through MLflow's tracking store with an
explicit tracking URI and experiment ids (no global MLflow state, no fluent span API, no async
queue that drops traces when full), so an error reaches the pipeline, which retries. Trace and
span ids are derived from the record id (the trace id is `tr-<record id>`), so a retried batch
rewrites the same traces. Per tracking URI:
- a database (`sqlite:///...`, ...), in process: one `start_trace` per trajectory (tags,
  metadata, previews), then the spans of the whole batch in one `log_spans` call: 100 traces
  of 10 spans in ~1.2 s, where MLflow's span-by-span client takes 25-48 s;
- an `http(s)://` server: the spans only, over OTLP (`POST /v1/traces`, protobuf, header
  `x-mlflow-experiment-id`, sent by MLflow's own client), the trace tags riding on the root span
  as `mlflow.traceTag.<k>`; the server creates the trace. The run link is `link_traces_to_run`
  (there is no `mlflow.sourceRun` metadata on this path);
- a file store (a path or `file:`; MLflow 3.17 wants `MLFLOW_ALLOW_FILE_STORE=true`): spans as
  trace artifacts; it cannot link traces to runs, so `mlflow.sourceRun` is the only link.

Step summaries become metrics of the run (`trace_proxy/trajectories_kept`, ...; validation
steps under `trace_proxy/validate/`). Step events are not exported.

The project (the MLflow experiment) and the record's experiment (the run's name) come from
requests and are given to MLflow as sent: MLflow 3.17 keeps names in its database (or a file
store's meta.yaml) and names directories by ids, so no name becomes a path (a test sends
`../..`, absolute paths, NUL and 256-character names to both stores). Names MLflow cannot
search for or store as they are (quotes, lengths, label names that are no tag names) are
handled in `mlflow_names.py`. A record MLflow refuses as invalid (`INVALID_PARAMETER_VALUE`,
`BAD_REQUEST`) would be refused on every retry: it is rejected (`ExportRejected`), so the
pipeline drops and counts it and the records after it still go out. So is a record whose
experiment was deleted in MLflow, since anyone sending requests can name one.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from trace_proxy.exporters.backends.mlflow_names import (
    MAX_EXPERIMENT_TAG_VALUE,
    NAME_DIGEST_TAG,
    PROJECT_TAG,
    label_tag,
    literal,
    substitute,
)
from trace_proxy.exporters.backends.spans import Generation, Tool, TrajectorySpans, trajectory_spans
from trace_proxy.exporters.base import ExportRejected
from trace_proxy.store.names import digest
from trace_proxy.trajectories.record import Annotation, Record, StepSummary, Trajectory, dumps

# Before MLflow is imported: a proxy never phones home; MLFLOW_DISABLE_TELEMETRY=false overrides.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# ImportError without the extra: the backend registry says `pip install 'trace-proxy[mlflow]'`.
from mlflow.entities import (
    Metric,
    Span,
    SpanType,
    TraceData,
    TraceInfo,
    TraceLocation,
    TraceState,
)
from mlflow.exceptions import MlflowException, RestException
from mlflow.store.tracking.rest_store import RestStore
from mlflow.tracing.client import TracingClient
from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)

ROOT_SPAN = "agent_loop"
LINKS_PER_CALL = 100  # MLflow's limit for link_traces_to_run
SPANS_PER_CALL = 500  # spans per log_spans request
PREVIEW_CHARS = 1000  # MLflow's own request/response preview length
_HEX32 = re.compile(r"[0-9a-f]{32}")
_NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"
# MLflow's answer to a request that is invalid as it is: retrying the same record cannot help.
REFUSED = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})
MAX_EXPERIMENT_NAME = 500  # MLflow refuses longer experiment names
MAX_RUN_NAME = 250  # the run table's name column (PostgreSQL and MySQL refuse longer names)
# Experiments and runs looked up, kept for the next records naming them: requests can name any
# number. One forgotten is looked up again; a run created here is ended when forgotten.
REMEMBERED = 4096


def _ns(seconds: float) -> int:
    """A record's time (epoch seconds) in ns, to the whole microsecond: MLflow's spans have
    always been drawn so (the other backends keep the float's exact value, `spans.ns`)."""
    return round(seconds * 1_000_000) * 1_000


def trace_id_of(record_id: str) -> str:
    """The MLflow trace id of a trajectory record: `tr-<record id>` (hashed if not 32 hex)."""
    if _HEX32.fullmatch(record_id) is None:
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
    chat = call.dialect == "openai.chat"
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
            "annotations": root.annotations or None,
            "summary": root.summary or None,
        }
    )
    error = root.status == "error"
    spans.insert(0, _SpanData(
        name=ROOT_SPAN, span_type=SpanType.AGENT, part=root.id, root=True,
        start=root.start, end=root.end, inputs=root_inputs, outputs=root_outputs,
        attributes=root_attributes, error=_root_error(view) if error else None,
    ))  # fmt: skip

    # verl's tags, as verl writes them (str() of the value), so the same filters work.
    tags = {"mlflow.traceName": ROOT_SPAN}
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


class MlflowExporter:
    """Exports trajectories to MLflow; every call happens in the pipeline's worker thread."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, project: str, run: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.project = project  # the experiment of records that name no project
        self.run = run  # a run id, or a run name; None: the record's experiment name
        self._client: MlflowClient | None = None
        self._tracing: TracingClient | None = None
        self._experiments: OrderedDict[str, str] = OrderedDict()  # by name, latest last
        self._runs: OrderedDict[tuple[str, str], str] = OrderedDict()  # by (experiment, name)
        self._created_runs: dict[str, None] = {}  # created here, not ended yet, in order
        scheme = urlsplit(tracking_uri).scheme.lower()
        self._remote = scheme in ("http", "https")
        # MLflow's file store (a path or file: URI) keeps spans as trace artifacts and cannot
        # link traces to runs: the `mlflow.sourceRun` metadata is the link there.
        self._file_store = scheme in ("", "file") or len(scheme) == 1  # or a drive letter
        self._log_spans = not self._file_store  # False once a store refuses spans

    # The clients are made in the worker thread, on first use: nothing blocks the event loop.
    def _clients(self) -> tuple[MlflowClient, TracingClient]:
        if self._client is None or self._tracing is None:
            uri = self.tracking_uri
            if uri.startswith("sqlite:///"):
                path = uri.removeprefix("sqlite:///").split("?", 1)[0]
                if path and path != ":memory:":
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._client = MlflowClient(tracking_uri=uri)
            self._tracing = TracingClient(uri)
        return self._client, self._tracing

    def export(self, records: list[Record]) -> None:
        try:
            self._export(records)
        except MlflowException as exc:
            if exc.error_code not in REFUSED:
                raise
            raise ExportRejected(
                f"mlflow: {self.tracking_uri} refused it ({exc.error_code}): {exc.message}"
            ) from exc

    def _export(self, records: list[Record]) -> None:
        traces: list[tuple[TraceRecord, str]] = []  # (trace, experiment id)
        for record in records:
            if not isinstance(record, Trajectory):
                continue
            experiment_id = self.experiment_id(record.key.project or self.project)
            run_id = self.run_id(experiment_id, record.key.experiment)
            try:
                traces.append((render(record, run_id), experiment_id))
            except Exception:  # a bug: retrying would not help, and must not block the rest
                log.exception("mlflow: trajectory %s could not be rendered; skipped", record.id)
        self._write_traces(traces)
        for record in records:
            if isinstance(record, Annotation):
                self._annotate(record)
            elif isinstance(record, StepSummary):
                self._log_summary(record)

    def close(self) -> None:
        """Writes are synchronous: only the runs this exporter created are ended."""
        if self._client is None:
            return
        for run_id in self._created_runs:
            self._end(run_id)
        self._created_runs.clear()

    def _end(self, run_id: str) -> None:
        assert self._client is not None
        try:
            self._client.set_terminated(run_id)
        except Exception:
            log.exception("mlflow: could not end run %s", run_id)

    # --- experiments and runs ---

    def experiment_id(self, name: str) -> str:
        """The experiment named `name`, found or created; when the store cannot hold or find
        that name (see mlflow_names.py), the one named by its substitute."""
        cached = self._experiments.get(name)
        if cached is not None:
            self._experiments.move_to_end(name)
            return cached
        experiment_id: str | None = None
        if len(name) <= MAX_EXPERIMENT_NAME and not (self._file_store and "'" in name):
            try:
                experiment_id = self._experiment_named(name)
            except MlflowException as exc:  # e.g. a server whose own store is a file store
                if exc.error_code not in REFUSED:
                    raise
                log.warning("mlflow: experiment name %r refused (%s); using a substitute",
                            name, exc.message)  # fmt: skip
        if experiment_id is None:
            stored = substitute(name, MAX_EXPERIMENT_NAME)
            experiment_id = self._experiment_named(stored, name)
            if experiment_id is None:
                raise ExportRejected(f"mlflow: the store finds no experiment named {stored!r}")
        self._experiments[name] = experiment_id
        if len(self._experiments) > REMEMBERED:
            self._experiments.popitem(last=False)
        return experiment_id

    def _experiment_named(self, stored: str, project: str | None = None) -> str | None:
        """The id of the experiment named `stored`, created if missing (tagged with `project`
        when that is what it stands for); None when the store finds another one for it."""
        client, _ = self._clients()
        experiment = client.get_experiment_by_name(stored)
        if experiment is None:
            tags = {PROJECT_TAG: project[:MAX_EXPERIMENT_TAG_VALUE]} if project else None
            try:
                return str(client.create_experiment(stored, tags=tags))
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = client.get_experiment_by_name(stored)  # created meanwhile
                if experiment is None:
                    raise
        if experiment.name != stored:
            return None
        if experiment.lifecycle_stage != "active":
            raise ExportRejected(
                f"mlflow: experiment {experiment.name!r} is deleted: its records are dropped "
                "until it is restored"
            )
        return str(experiment.experiment_id)

    def run_id(self, experiment_id: str, experiment_name: str) -> str:
        """The run traces are linked to: `run` as a run id if one exists, else as a run name
        (the record's experiment name by default) found, or created, in the experiment."""
        name = self.run or experiment_name
        cache_key = (experiment_id, name)
        cached = self._runs.get(cache_key)
        if cached is not None:
            self._runs.move_to_end(cache_key)
            return cached
        client, _ = self._clients()
        run_id: str | None = None
        if self.run is not None and _HEX32.fullmatch(self.run):
            try:
                run_id = str(client.get_run(self.run).info.run_id)
            except MlflowException as exc:
                if exc.error_code != _NOT_FOUND:
                    raise
        if run_id is None:
            # By name, else (a name no filter can quote, or one too long to be stored) by the
            # hash of the name that every run created here carries as a tag.
            quoted = literal(name) if len(name) <= MAX_RUN_NAME else None
            if quoted is not None:
                by = f"attributes.run_name = {quoted}"
            else:
                by = f"tags.`{NAME_DIGEST_TAG}` = '{digest(name)}'"
            found = client.search_runs(
                [experiment_id],
                filter_string=by,
                max_results=1,
                order_by=["attributes.start_time DESC"],
            )
            if found:
                run_id = str(found[0].info.run_id)
            else:
                created = client.create_run(
                    experiment_id,
                    run_name=name if len(name) <= MAX_RUN_NAME else substitute(name, MAX_RUN_NAME),
                    tags={"mlflow.source.name": "trace-proxy", NAME_DIGEST_TAG: digest(name)},
                )
                run_id = str(created.info.run_id)
                self._created_runs[run_id] = None
        self._runs[cache_key] = run_id
        if len(self._runs) > REMEMBERED:
            _, forgotten = self._runs.popitem(last=False)
            if forgotten in self._created_runs:  # found again by name if needed, ended now
                del self._created_runs[forgotten]
                self._end(forgotten)
        return run_id

    # --- writing ---

    def _write_traces(self, traces: list[tuple[TraceRecord, str]]) -> None:
        """In process: `start_trace` (tags, metadata, previews) then the spans in bulk. To a
        server: the spans only, over OTLP, the tags riding on the root span (MLflow turns
        `mlflow.traceTag.<k>` into trace tags): one request per 500 spans instead of one per
        trace, about 3x faster. A store that cannot take spans gets them as trace artifacts."""
        if not traces:
            return
        _, tracing = self._clients()
        by_experiment: dict[str, list[tuple[TraceRecord, TraceInfo, list[Span]]]] = {}
        for trace, experiment_id in traces:
            info = TraceInfo(
                trace_id=trace.trace_id,
                trace_location=TraceLocation.from_experiment_id(experiment_id),
                request_time=trace.start_ns // 1_000_000,
                execution_duration=(trace.end_ns - trace.start_ns) // 1_000_000,
                state=TraceState.ERROR if trace.error else TraceState.OK,
                request_preview=trace.request_preview,
                response_preview=trace.response_preview,
                client_request_id=trace.record_id,
                trace_metadata=dict(trace.metadata),
                tags=dict(trace.info_tags),
            )
            spans = to_mlflow_spans(trace, experiment_id, tags_on_root=self._remote)
            by_experiment.setdefault(experiment_id, []).append((trace, info, spans))
        for experiment_id, items in by_experiment.items():
            started: list[TraceInfo] = []
            if self._log_spans and not self._remote:
                started = [tracing.start_trace(info) for _, info, _ in items]
            if self._log_spans:
                spans = [span for _, _, trace_spans in items for span in trace_spans]
                try:
                    for chunk in _chunks(spans, SPANS_PER_CALL):
                        tracing.log_spans(experiment_id, chunk)
                except (NotImplementedError, RestException) as exc:
                    if isinstance(exc, RestException) and "not supported" not in exc.message:
                        raise
                    if self._remote and "could not identify" in str(exc):
                        # GET /version failed: MLflow asks it once, without retrying, and
                        # caches the failure for the process. Transient: forget it, retry.
                        RestStore._get_server_version.cache_clear()
                        raise
                    log.info("mlflow: %s keeps spans as trace artifacts", self.tracking_uri)
                    self._log_spans = False
            if not self._log_spans:
                if not started:
                    started = [tracing.start_trace(info) for _, info, _ in items]
                for (_, _, trace_spans), info in zip(items, started, strict=True):
                    tracing._upload_trace_data(info, TraceData(spans=trace_spans))
            self._link(items)

    def _link(self, items: list[tuple[TraceRecord, TraceInfo, list[Span]]]) -> None:
        if self._file_store:
            return
        client, _ = self._clients()
        by_run: dict[str, list[str]] = {}
        for trace, _, _ in items:
            run_id = trace.metadata.get("mlflow.sourceRun")
            if run_id is not None:
                by_run.setdefault(run_id, []).append(trace.trace_id)
        for run_id, trace_ids in by_run.items():
            for chunk in _chunks(trace_ids, LINKS_PER_CALL):
                client.link_traces_to_run(chunk, run_id)

    def _annotate(self, note: Annotation) -> None:
        """A late reward: set as tags on the traces of the trajectories it names."""
        tags = outcome_tags(note.reward, note.score, note.labels)
        if not tags:
            return
        _, tracing = self._clients()
        for record_id in note.trajectories:
            trace_id = trace_id_of(record_id)
            try:  # a store may not say "not found" when tagging a missing trace: ask first
                tracing.get_trace_info(trace_id)
            except MlflowException as exc:
                if exc.error_code != _NOT_FOUND:
                    raise
                log.info("mlflow: no trace %s for a late reward; not exported here", trace_id)
                continue
            for key, value in tags.items():
                tracing.set_trace_tag(trace_id, key, value)

    def _log_summary(self, summary: StepSummary) -> None:
        if summary.step is None:
            return
        client, _ = self._clients()
        experiment_id = self.experiment_id(summary.project or self.project)
        run_id = self.run_id(experiment_id, summary.experiment)
        prefix = "trace_proxy/validate/" if summary.validate else "trace_proxy/"
        now = int(time.time() * 1000)
        metrics = [
            Metric(prefix + name, float(getattr(summary, name)), now, summary.step)
            for name in (
                "trajectories_seen", "trajectories_kept", "trajectories_dropped_by_sampler",
                "calls_seen", "calls_kept", "calls_dropped_by_sampler",
            )
        ]  # fmt: skip
        client.log_batch(run_id, metrics=metrics)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True)
class MlflowConfig:
    """What the mlflow backend is told: `--mlflow-tracking-uri` (None: the default below),
    `--output` (where that default database goes), `--project`, `--mlflow-run`."""

    tracking_uri: str | None
    output: Path
    project: str
    run: str | None = None


def default_tracking_uri(config: MlflowConfig) -> str:
    """--mlflow-tracking-uri, else MLFLOW_TRACKING_URI, else sqlite under --output."""
    if config.tracking_uri:
        return config.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return "sqlite:///" + str((config.output / "mlflow.db").absolute())


def create(config: MlflowConfig) -> MlflowExporter:
    return MlflowExporter(default_tracking_uri(config), config.project, config.run)


__all__ = ["MlflowConfig", "MlflowExporter", "create", "render", "trace_id_of"]
