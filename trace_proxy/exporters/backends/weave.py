"""The Weave backend (W&B Weave, weave 0.54): one call tree per trajectory.

Calls are built by Weave's own client (`WeaveClient` over `RemoteHTTPTraceServer`), so the
server sees what the Python SDK sends, in its `calls/complete` form:

- a root call, op `agent_loop`, display name `step 3 · sample 17 · rollout 2` (`· validate`,
  `· part 2` when they apply), with the record's exact start and end times; attributes
  `step`, `sample_index`, `rollout_n`, `validate`, `experiment_name`, `trajectory_id`,
  `project`, `record_id`, and `reward`, `score`, `labels` when known; inputs: the key fields;
  output: reward, score, labels, status, close reason, the record summary;
- a child per generate call, op `chat` / `completions` / `generate` (by dialect), display name
  `<op> <model>`: inputs the full messages (chat, with `model`, `tools`, sampling) or the stored
  prompt token ids and `prompt_text` (token dialects; shared prefixes stay references:
  `prefix_call`, `prefix_len`); output OpenAI-shaped (`choices[].message` with text and
  tool calls, `finish_reason`, `token_ids`, `response_text`) plus `usage`, which Weave itself
  copies into the call's summary (`usage.<model>`); a failed call is an exception;
- a child per tool call, op `execute_tool`, display name the tool's name.

Call ids are derived from the record id (the root's id is also its trace id), so a retried
batch rewrites the same calls (`calls/complete` is an upsert by id).

Delivery. Weave's batching is not used. Its batch processor sends from a background thread and
tells the caller nothing; a batch that fails is re-queued and retried in the background until
the next `flush()`, which drops it after one more round; and `flush()` waits up to 5 minutes
for a call start that never comes (one whose op could not be saved while the server was down).
Instead the binding is unbatched and keeps the call starts and ends the client hands it
(`_CallCollector`); `export()` renders the batch, waits for the client's deferred work
(`WeaveClient.flush()`: saving the ops, `file/create` then `obj/create`, and the starts and
ends), pairs each start with its end into a `calls/complete` item as weave's
`CallBatchProcessor` does, and posts the items itself, synchronously, through the binding's
`calls_complete` (one request per `request_budget` bytes; a trajectory's root after its
children). So `export()` returns once the server accepted every call of the batch, and raises
otherwise: `WeaveExportError` (the pipeline retries the batch), or `ExportRejected` when the
server refuses calls as too large or invalid (413, 422: the pipeline drops the record at fault).
Calls the server accepted within a batch that then failed are not sent again by its retry. A
record that cannot be rendered raises its own error (KeyError, TypeError, ...).

Weave's own retries come first, in the exporting thread: the HTTP client tries each request 3
times (0.5 s, 1 s apart) on 408/409/429/5xx and connection errors, each try bounded by
`WEAVE_HTTP_TIMEOUT` (30 s), and a `calls/complete` request is repeated that way
`WEAVE_RETRY_MAX_ATTEMPTS` times (3, 1 s and 2 s apart). A server answering 5xx costs an export
about 8 s; one that never answers at most about 5 minutes (3 x 3 x 30 s). Nothing is queued
between exports: when `export()` has returned or raised, no weave thread is sending or retrying
anything, and `close()` has nothing left to send.

Weave internals relied on (checked against weave 0.54.0):
- `create_call(..., _call_id_override=...)`, a private keyword: the derived call ids above;
- that `WeaveClient` hands call starts and ends to the binding's `call_start` / `call_end`
  when the binding has no call processor (`RemoteHTTPTraceServer(should_batch=False)`), and
  the fields of a `calls/complete` item (`END_FIELDS` from the end, the rest from the start,
  as in `CallBatchProcessor._create_complete`);
- `weave_client_context.set_weave_client_global`: `create_call` records nothing unless some
  client is the global one (`weave.init` normally sets it);
- that a failed request's exception carries the HTTP `response` (the status tells 413/422).
Public, but worth knowing: `weave.trace.settings.override_settings` (no call link is logged per
trajectory: `WEAVE_PRINT_CALL_LINK` set in the environment still wins), and Sentry: weave
reports its own errors there unless `WANDB_ERROR_REPORTING=false` (set by default below; it
hangs offline), read once when weave is first imported, so this module must be what imports
weave first (it is, in the proxy).

Configuration (`create`): entity from `--weave-entity` or `WANDB_ENTITY` (required), project
`--project`, API key `WANDB_API_KEY` (required), server `WF_TRACE_SERVER_URL`, else Weave's default
(`https://trace.wandb.ai`, or `$WANDB_BASE_URL/traces` for a dedicated W&B server). Records
of every project go to that one Weave project (the record's own project is an attribute).
Not exported: late rewards (annotations), step events, step summaries.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from trace_proxy.exporters.backends import spans
from trace_proxy.exporters.base import Exporter, ExportRejected
from trace_proxy.trajectories.record import KEY_FIELDS, Record, Trajectory, dumps

if TYPE_CHECKING:
    from weave.trace.call import Call
    from weave.vendor.weave_server_sdk.types import CallEndParams, CallStartParams

# Before weave is imported: a proxy never phones home (weave reports its own errors to Sentry);
# WANDB_ERROR_REPORTING=true overrides.
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")

# ImportError without the extra: the backend registry says `pip install 'trace-proxy[weave]'`.
# The resources package first: weave's client imports each resource module on first use, from
# whichever of its worker threads gets there first, and two threads importing the package and
# one of its modules at once can fail with `_DeadlockError` and lose an op save. Imported here,
# once, every resource module is loaded before any worker thread runs.
import weave.vendor.weave_server_sdk.resources  # noqa: F401
from weave.trace import settings as weave_settings
from weave.trace.context import weave_client_context
from weave.trace.env import weave_trace_server_url
from weave.trace.weave_client import WeaveClient
from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer
from weave.vendor.weave_server_sdk.types import CallStartResponse

TOOL_OP = "execute_tool"
_IDS = uuid.UUID("6f1c1d1e-3a57-4a0e-9a53-7472616365f0")  # namespace of derived call ids
REQUEST_BUDGET = 8_000_000  # bytes of calls per calls/complete request (weave's limit: 31 MiB)
# The fields of a calls/complete item that come from the call's end; all others: its start.
END_FIELDS = ("ended_at", "output", "summary", "exception", "wb_run_step_end")
REJECTED_STATUSES = (413, 422)  # too large, invalid: the same calls would fail every time
JSON = dict[str, Any]


class CallFailed(Exception):
    """A generate or tool call that failed, as Weave records it (`exception`)."""


class WeaveExportError(RuntimeError):
    """The server did not accept every call of a batch (the pipeline retries it)."""


class _CallCollector(RemoteHTTPTraceServer):
    """Weave's HTTP binding, unbatched, keeping the call starts and ends the client hands it
    (from the client's worker threads) until `export()` takes them."""

    def __init__(self, url: str) -> None:
        super().__init__(url, should_batch=False)
        self._lock = threading.Lock()
        self._starts: dict[str, Mapping[str, Any]] = {}
        self._ends: dict[str, Mapping[str, Any]] = {}

    def call_start(self, req: CallStartParams) -> CallStartResponse:
        start: Mapping[str, Any] = req["start"]
        with self._lock:
            self._starts[start["id"]] = start
        return CallStartResponse(id=start["id"], trace_id=start["trace_id"])

    def call_end(self, req: CallEndParams) -> object:
        end: Mapping[str, Any] = req["end"]
        with self._lock:
            self._ends[end["id"]] = end
        return {}

    def take(self) -> dict[str, JSON]:
        """Every call both started and ended since the last take, as a calls/complete item, by
        id; everything else is forgotten."""
        with self._lock:
            starts, ends = self._starts, self._ends
            self._starts, self._ends = {}, {}
        complete: dict[str, JSON] = {}
        for id_, start in starts.items():
            end = ends.get(id_)
            if end is not None:
                complete[id_] = {**start, **{name: end.get(name) for name in END_FIELDS}}
        return complete


class WeaveExporter(Exporter):
    name = "weave"
    request_budget = REQUEST_BUDGET

    def __init__(
        self,
        entity: str,
        project: str,
        *,
        server_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        key = api_key or os.environ.get("WANDB_API_KEY")
        if not key:
            raise ValueError("the weave backend needs a W&B API key (WANDB_API_KEY)")
        if not entity or not project:
            raise ValueError("the weave backend needs an entity (WANDB_ENTITY) and a project")
        if weave_settings.should_disable_weave():
            raise ValueError("WEAVE_DISABLED is set: the weave backend would record nothing")
        if weave_settings.should_enable_wal():
            raise ValueError(
                "WEAVE_ENABLE_WAL is set: the weave backend sends its calls itself (the proxy's "
                "spool is its durable queue); unset it"
            )
        self.entity, self.project = entity, project
        self.server_url = server_url or weave_trace_server_url()
        self._server = _CallCollector(self.server_url)
        self._server.set_auth(("api", key))
        self._client = WeaveClient(entity, project, self._server, ensure_project_exists=False)
        # Weave records nothing unless some client is the global one.
        weave_client_context.set_weave_client_global(self._client)
        self._lock = threading.Lock()
        self._sent: set[str] = set()  # calls of a failing batch the server already accepted
        self._closed = False

    def export(self, records: list[Record]) -> None:
        trajectories = [r for r in records if isinstance(r, Trajectory)]
        if not trajectories:
            return  # annotations, step events and step summaries: not exported
        with self._lock:
            weave_client_context.set_weave_client_global(self._client)  # if none is
            rendered: list[list[str]] = []  # each trajectory's call ids, its root last
            try:
                with weave_settings.override_settings(print_call_link=False):
                    for record in trajectories:
                        view = spans.trajectory_spans(orjson.loads(dumps(record)))
                        rendered.append(self._log_trajectory(view))
            finally:
                self._client.flush()  # the client's deferred work: op saves, starts, ends
                complete = self._server.take()
            items: list[JSON] = []
            unready = 0
            for ids in rendered:
                if all(id_ in complete for id_ in ids):
                    items += [complete[id_] for id_ in ids if id_ not in self._sent]
                else:
                    unready += 1
            self._send(items)
            if unready:
                raise WeaveExportError(
                    f"weave: {unready} of {len(rendered)} trajectories could not be prepared "
                    "(their ops could not be saved to "
                    f"{self.server_url}: see weave's log for the reason)"
                )
            for ids in rendered:
                self._sent.difference_update(ids)

    def close(self) -> None:
        """Nothing is queued between exports: waits for any work of the client still running
        (none, unless an export was interrupted), and stops being weave's global client."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._client.flush()
            self._server.take()
            if weave_client_context.get_weave_client() is self._client:
                weave_client_context.set_weave_client_global(None)

    def _send(self, items: list[JSON]) -> None:
        chunk: list[JSON] = []
        size = 0
        for item in items:
            cost = len(orjson.dumps(item, default=str))
            if chunk and size + cost > self.request_budget:
                self._post(chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += cost
        if chunk:
            self._post(chunk)

    def _post(self, items: list[JSON]) -> None:
        """One calls/complete request, synchronous, with weave's retries."""
        try:
            self._server.calls_complete({"batch": items})
        except Exception as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in REJECTED_STATUSES:
                raise ExportRejected(
                    f"weave: {self.server_url} refused {len(items)} calls for good "
                    f"(HTTP {status}): {exc}"
                ) from exc
            raise WeaveExportError(
                f"weave: {self.server_url} did not accept {len(items)} calls: {exc}"
            ) from exc
        self._sent.update(str(item["id"]) for item in items)

    def _log_trajectory(self, view: spans.TrajectorySpans) -> list[str]:
        """Have the client build the trajectory's calls; their ids, the root's last."""
        root = view.root
        record_id = str(root.record_id)
        root_id = call_id(record_id, root.id)
        root_call = self._client.create_call(
            spans.ROOT_NAME,
            inputs=root_inputs(root),
            attributes=root_attributes(root),
            display_name=display_name(root),
            started_at=spans.utc(root.start),
            use_stack=False,
            _call_id_override=root_id,
        )
        ids: list[str] = []
        for call in view.calls:
            child_id = call_id(record_id, call.id)
            op = call.declared.operations.weave
            self._child(
                root_call,
                child_id,
                op,
                inputs=generation_inputs(call),
                attributes=generation_attributes(call, root),
                display=f"{op} {call.model or ''}".strip(),
                span=call,
                output=generation_output(call),
            )
            ids.append(child_id)
        for tool in view.tools:
            child_id = call_id(record_id, tool.id)
            self._child(
                root_call,
                child_id,
                TOOL_OP,
                inputs=tool_inputs(tool),
                attributes=tool_attributes(tool),
                display=str(tool.name or TOOL_OP),
                span=tool,
                output=tool.result,
            )
            ids.append(child_id)
        self._client.finish_call(root_call, output=root_output(root), ended_at=spans.utc(root.end))
        ids.append(root_id)
        return ids

    def _child(
        self,
        root: Call,
        id_: str,
        op: str,
        *,
        inputs: JSON,
        attributes: JSON,
        display: str,
        span: spans.Generation | spans.Tool,
        output: Any,
    ) -> None:
        child = self._client.create_call(
            op,
            inputs=inputs,
            parent=root,
            attributes=attributes,
            display_name=display,
            started_at=spans.utc(span.start),
            use_stack=False,
            _call_id_override=id_,
        )
        self._client.finish_call(
            child,
            output=output,
            exception=failure(span.error),
            ended_at=spans.utc(span.end or span.start),
        )


@dataclass(frozen=True)
class WeaveConfig:
    """What the weave backend is told: `--weave-entity` (None: WANDB_ENTITY) and `--project`."""

    entity: str | None
    project: str


def create(config: WeaveConfig) -> WeaveExporter:
    """Entity from --weave-entity or WANDB_ENTITY, project from --project, key from
    WANDB_API_KEY, server from WF_TRACE_SERVER_URL (else Weave's default)."""
    entity = config.entity or os.environ.get("WANDB_ENTITY", "")
    if not entity:
        raise ValueError(
            "the weave backend needs --weave-entity or WANDB_ENTITY (the W&B entity to log to)"
        )
    return WeaveExporter(entity, config.project)


# --- rendering ---------------------------------------------------------------------------------


def call_id(record_id: str, what: str) -> str:
    return str(uuid.uuid5(_IDS, f"{record_id}/{what}"))


def display_name(root: spans.Root) -> str:
    key = root.key
    parts = [
        f"{label} {key[field]}"
        for label, field in (("step", "step"), ("sample", "sample_index"), ("rollout", "rollout_n"))
        if key.get(field) is not None
    ]
    if key.get("validate"):
        parts.append("validate")
    if (root.part or 1) > 1:
        parts.append(f"part {root.part}")
    if not parts:
        parts.append(f"trajectory {key.get('trajectory_id') or root.record_id}")
    return " · ".join(parts)


def root_inputs(root: spans.Root) -> JSON:
    return {field: root.key.get(field) for field in KEY_FIELDS}


def root_attributes(root: spans.Root) -> JSON:
    key = root.key
    attributes: JSON = {
        "step": key.get("step"),
        "sample_index": key.get("sample_index"),
        "rollout_n": key.get("rollout_n"),
        "validate": key.get("validate"),
        "experiment_name": key.get("experiment"),
        "trajectory_id": key.get("trajectory_id"),
        "project": key.get("project"),
        "record_id": root.record_id,
        **{name: value for name, value in root.policy_fields().items() if value is not None},
    }
    if root.reward is not None:
        attributes["reward"] = root.reward
    if root.score is not None:
        attributes["score"] = root.score
    if root.labels:
        attributes["labels"] = root.labels
    return attributes


def root_output(root: spans.Root) -> JSON:
    return {
        "reward": root.reward,
        "score": root.score,
        "labels": root.labels,
        "status": root.status,
        "close_reason": root.close_reason,
        "summary": root.summary,
    }


def generation_inputs(call: spans.Generation) -> JSON:
    prompt, full_prompt = call.stored_prompt, call.prompt
    inputs: JSON = {"model": call.model}
    if full_prompt.get("messages") is not None:
        inputs["messages"] = full_prompt["messages"]
        if full_prompt.get("tools") is not None:
            inputs["tools"] = full_prompt["tools"]
    else:
        if prompt.get("token_ids") is not None:
            inputs["prompt_token_ids"] = prompt["token_ids"]
        if prompt.get("text") is not None:
            inputs["prompt"] = prompt["text"]
        if call.prompt_piece is not None:
            inputs["prompt_text"] = call.prompt_piece
        if prompt.get("prefix_call") is not None:
            inputs["prefix_call"] = prompt["prefix_call"]
            inputs["prefix_len"] = prompt.get("prefix_len")
    inputs.update(call.sampling or {})
    return inputs


def generation_output(call: spans.Generation) -> JSON:
    choices = []
    for output in call.outputs:
        message: JSON = {"role": "assistant", "content": output.get("text")}
        if output.get("tool_calls"):
            message["tool_calls"] = output["tool_calls"]
        if output.get("reasoning"):
            message["reasoning_content"] = output["reasoning"]
        choice: JSON = {
            "index": output.get("index"),
            "message": message,
            "finish_reason": output.get("finish_reason"),
        }
        for name in ("stop_reason", "token_ids", "response_text"):
            if output.get(name) is not None:
                choice[name] = output[name]
        choices.append(choice)
    rendered: JSON = {"id": call.request_id, "model": call.model, "choices": choices}
    if call.usage:  # weave sums `usage` into the call's summary, keyed by `model`
        rendered["usage"] = call.usage
    return rendered


def generation_attributes(call: spans.Generation, root: spans.Root) -> JSON:
    return {
        "index": call.index,
        "dialect": call.dialect,
        "route": call.route,
        "upstream": call.upstream,
        "request_id": call.request_id,
        "http_status": call.http_status,
        "stream": call.stream,
        "weight_version": call.weight_version,
        "version_lag": root.lag_of(call),
        "ttft_ms": spans.duration_ms(call.start, call.first_byte),
    }


def tool_inputs(tool: spans.Tool) -> JSON:
    return {"name": tool.name, "arguments": tool.parsed_arguments, "call_id": tool.call_id}


def tool_attributes(tool: spans.Tool) -> JSON:
    attributes: JSON = {
        "index": tool.index,
        "observed": tool.observed,
        "requested_by": tool.requested_by,
    }
    for name in ("raw", "route", "upstream", "http_status"):
        if getattr(tool, name) is not None:
            attributes[name] = getattr(tool, name)
    return attributes


def failure(error: JSON | None) -> BaseException | None:
    text = spans.error_text(error)
    return None if text is None else CallFailed(text)
