"""A fake MLflow tracking server: the routes MLflow 3.17's REST client uses to export traces.

mlflow-skinny ships the client, not a runnable server (`mlflow server` needs the full `mlflow`
package), so this follows the wire as installed, mlflow-skinny 3.17.2:
- the client side: `mlflow/store/tracking/rest_store.py` (`RestStore`: `get_experiment_by_name`,
  `create_experiment`, `get_run`, `_search_runs`, `create_run`, `update_run_info`, `log_batch`,
  `link_traces_to_run`, `get_trace_info`, `set_trace_tag`, `_get_server_version`, and
  `log_spans`, which posts OTLP), `mlflow/utils/rest_utils.py` (`call_endpoint`: GET sends the
  request message as query parameters, the others as a JSON body; `verify_rest_response`: an
  error is `{"error_code", "message"}` JSON; `get_single_trace_endpoint`,
  `get_trace_tag_endpoint`), `mlflow/utils/proto_json_utils.py` (`message_to_json`: proto
  field names, int64 as numbers; `parse_dict` ignores unknown fields, so a misspelt field here
  would be silently lost: the tests assert on what the client makes of the answers),
  `mlflow/tracing/utils/otlp.py` (`/v1/traces`, `x-mlflow-experiment-id`, `x-mlflow-run-id`,
  how span attributes become OTLP `AnyValue`s) and `mlflow/entities/span.py` (`to_otel_proto`);
- the routes and messages: the `MlflowService` rpc options and messages of
  `mlflow/protos/service_pb2.pyi` (`Experiment`, `Run`, `RunInfo`, `RunData`, `TraceInfoV3`,
  `TraceLocation`, the request and `Response` messages);
- the server side, whose handlers mlflow-skinny also ships: `mlflow/server/handlers.py`
  (`_get_experiment_by_name`, `_create_experiment`, `_get_run`, `_search_runs`, `_create_run`,
  `_update_run`, `_log_batch`, `_link_traces_to_run`, `_get_trace_info_v3`, `_set_trace_tag`,
  `catch_mlflow_exception`), `mlflow/server/otel_api.py` (`export_traces`),
  `mlflow/server/__init__.py` (`/version`), `mlflow/exceptions.py` (error code to HTTP status)
  and `mlflow/store/tracking/sqlalchemy_store.py` (`create_experiment`, `create_run`,
  `_log_spans_once`: how a trace is made from its spans, `mlflow.traceTag.<k>` root attributes
  becoming trace tags, `_get_trace_status_from_root_span`).

Routes (paths as `RestStore` builds them; `{id}` is a trace id `tr-<32 hex>`):
- `GET /version`: the server's version as text (`log_spans` refuses a server older than 3.4).
- `GET /api/2.0/mlflow/experiments/get-by-name?experiment_name=`: `{"experiment": {...}}`, or
  404 `RESOURCE_DOES_NOT_EXIST`; deleted experiments are found too (lifecycle_stage "deleted").
- `POST /api/2.0/mlflow/experiments/create` `{"name", "artifact_location"?, "tags"?}`:
  `{"experiment_id": "1"}` (ids count up from 1, "0" is "Default"); a taken name: 400
  `RESOURCE_ALREADY_EXISTS`.
- `GET /api/2.0/mlflow/runs/get?run_uuid=&run_id=`: `{"run": {...}}`, or 404.
- `POST /api/2.0/mlflow/runs/search` `{"experiment_ids", "filter", "run_view_type",
  "max_results", "order_by"}`: `{"runs": [...]}`, newest first. Only the filters a client of
  this project sends are understood (none, or `attributes.run_name = '<name>'`, either quote),
  and only the order `attributes.start_time DESC`; others answer 400, never a wrong result.
- `POST /api/2.0/mlflow/runs/create` `{"experiment_id", "user_id", "start_time", "tags",
  "run_name"}`: `{"run": {...}}`, RUNNING, with the `mlflow.runName` tag added.
- `POST /api/2.0/mlflow/runs/update` `{"run_id", "run_uuid", "status", "end_time"}`:
  `{"run_info": {...}}`.
- `POST /api/2.0/mlflow/runs/log-batch` `{"run_id", "metrics", "params", "tags"}`: `{}`.
- `POST /api/2.0/mlflow/traces/link-to-run` `{"trace_ids", "run_id"}`: `{}`; more than 100
  ids: 400 `INVALID_PARAMETER_VALUE`. Like MLflow's SQL store, ids are not checked.
- `GET /api/3.0/mlflow/traces/{id}`: `{"trace": {"trace_info": TraceInfoV3}}`, or 404.
- `PATCH /api/2.0/mlflow/traces/{id}/tags` `{"key", "value"}`: `{}`, or 404 for an unknown trace.
- `POST /v1/traces`: OTLP/HTTP, an `ExportTraceServiceRequest` (protobuf, or OTLP JSON), header
  `x-mlflow-experiment-id` required (422 without, as FastAPI answers), of an existing
  experiment (404 else: stricter than MLflow, whose store fails on it one way or another),
  optional `x-mlflow-run-id` (links the traces whose root span came). Errors as
  `otel_api.export_traces` answers them (400 for a wrong Content-Type, an undecodable body or
  no spans; 422 for a span without ids). Spans are upserted by (trace id, span id), as the
  store does; a trace is made or updated from them: id `tr-<hex>`, the experiment of the
  header, request time and duration from the spans, state from the root span's status, tags
  from the root's `mlflow.traceTag.<k>` attributes. Answers an empty
  `ExportTraceServiceResponse` (application/x-protobuf). Not modelled: request and response
  previews, token usage and other trace metadata the server derives from the spans.
- anything else: 404 `{"error_code": "ENDPOINT_NOT_FOUND", ...}` (what MLflow's client makes of
  a 404), recorded, so a test sees a route it did not expect.

Every request is recorded (`requests`, with the status answered); OTLP posts are also kept
decoded (`exports`). `fail("POST /v1/traces", 503)` makes a route answer that status (with
MLflow's error JSON) until `recover()`; such requests are recorded and change nothing.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from google.protobuf.json_format import ParseDict
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from fakes.serving import serve_app

VERSION = "3.17.2"  # what `GET /version` answers: the client this fake follows
API = "/api/2.0/mlflow"
API3 = "/api/3.0/mlflow"
OTLP = "/v1/traces"
EXPERIMENT_HEADER = "x-mlflow-experiment-id"
RUN_HEADER = "x-mlflow-run-id"
TAG_PREFIX = "mlflow.traceTag."
LINKS_PER_REQUEST = 100
_ERROR_STATUS = {
    "INVALID_PARAMETER_VALUE": 400,
    "RESOURCE_ALREADY_EXISTS": 400,
    "RESOURCE_DOES_NOT_EXIST": 404,
    "ENDPOINT_NOT_FOUND": 404,
    "TEMPORARILY_UNAVAILABLE": 503,
    "INTERNAL_ERROR": 500,
}
_STATUS_ERROR = {503: "TEMPORARILY_UNAVAILABLE", 404: "ENDPOINT_NOT_FOUND", 400: "BAD_REQUEST"}
_RUN_NAME_FILTER = re.compile(
    r"""\s*(?:attributes|attribute|attr|run)\.run_name\s*=\s*(?:'(?P<s>[^']*)'|"(?P<d>[^"]*)")\s*"""
)
_START_TIME_DESC = re.compile(r"\s*(?:attributes|attribute|attr|run)\.start_time\s+DESC\s*", re.I)


class ApiError(Exception):
    """An MLflow error answer: `{"error_code", "message"}` with the code's HTTP status."""

    def __init__(self, error_code: str, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message

    def response(self) -> web.Response:
        return web.json_response(
            {"error_code": self.error_code, "message": self.message},
            status=_ERROR_STATUS.get(self.error_code, 500),
        )


def _now_ms() -> int:
    return int(time.time() * 1000)


def _required(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    if value in (None, "", []):
        raise ApiError("INVALID_PARAMETER_VALUE", f"Missing value for required parameter '{name}'.")
    return value


def decode_any_value(value: AnyValue) -> Any:
    """An OTLP `AnyValue` as a Python value (unset: None)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [decode_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: decode_any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any  # the JSON body; for OTLP, the decoded `OtlpExport`
    status: int = 0  # what was answered


@dataclass
class ReceivedSpan:
    """A span as it came over OTLP, ids as lowercase hex, attributes decoded."""

    trace_id: str  # 32 hex: the MLflow trace id is "tr-" + this
    span_id: str
    parent_span_id: str | None
    name: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: str  # STATUS_CODE_UNSET | STATUS_CODE_OK | STATUS_CODE_ERROR
    status_message: str
    attributes: dict[str, Any]
    events: list[dict[str, Any]]

    @property
    def mlflow_trace_id(self) -> str:
        return "tr-" + self.trace_id


@dataclass
class OtlpExport:
    """One `POST /v1/traces`."""

    headers: dict[str, str]
    resource: dict[str, Any]
    spans: list[ReceivedSpan]


@dataclass
class StoredTrace:
    trace_id: str
    experiment_id: str
    request_time_ms: int
    duration_ms: int | None
    state: str  # OK | ERROR | IN_PROGRESS
    tags: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def info_json(self) -> dict[str, Any]:
        """TraceInfoV3 in proto JSON (Timestamp: RFC 3339, Duration: seconds with an "s")."""
        when = datetime.fromtimestamp(self.request_time_ms / 1000, tz=timezone.utc)
        info: dict[str, Any] = {
            "trace_id": self.trace_id,
            "trace_location": {
                "type": "MLFLOW_EXPERIMENT",
                "mlflow_experiment": {"experiment_id": self.experiment_id},
            },
            "request_time": when.strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{when.microsecond // 1000:03d}Z",
            "state": self.state,
            "trace_metadata": dict(self.metadata),
            "tags": dict(self.tags),
        }
        if self.duration_ms is not None:
            info["execution_duration"] = f"{self.duration_ms / 1000:.3f}s"
        return info


@dataclass
class FakeMlflowServer:
    requests: list[Recorded] = field(default_factory=list)
    exports: list[OtlpExport] = field(default_factory=list)  # accepted OTLP posts, in order
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> Experiment JSON
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> Run JSON
    metrics: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # run id -> history
    spans: dict[tuple[str, str], ReceivedSpan] = field(default_factory=dict)  # latest by id
    traces: dict[str, StoredTrace] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)  # run id -> trace ids, in order
    failing: dict[str, int] = field(default_factory=dict)  # "METHOD route" -> status

    def __post_init__(self) -> None:
        self._next_experiment = 0
        self.add_experiment("Default")  # every MLflow server has experiment "0"

    # --- state a test sets up, as the server would hold it ---

    def add_experiment(self, name: str, *, lifecycle_stage: str = "active") -> str:
        if any(e["name"] == name for e in self.experiments.values()):
            raise ApiError("RESOURCE_ALREADY_EXISTS", f"Experiment(name={name}) already exists.")
        experiment_id = str(self._next_experiment)
        self._next_experiment += 1
        now = _now_ms()
        self.experiments[experiment_id] = {
            "experiment_id": experiment_id,
            "name": name,
            "artifact_location": f"mlflow-artifacts:/{experiment_id}",
            "lifecycle_stage": lifecycle_stage,
            "last_update_time": now,
            "creation_time": now,
        }
        return experiment_id

    def add_run(
        self,
        experiment_id: str,
        run_name: str,
        *,
        tags: dict[str, str] | None = None,
        user_id: str = "unknown",
        start_time: int | None = None,
    ) -> str:
        experiment = self.experiments.get(experiment_id)
        if experiment is None:
            raise ApiError(
                "RESOURCE_DOES_NOT_EXIST", f"No Experiment with id={experiment_id} exists"
            )
        if experiment["lifecycle_stage"] != "active":
            raise ApiError(
                "INVALID_PARAMETER_VALUE",
                f"The experiment {experiment_id} must be in the 'active' state.",
            )
        run_id = uuid.uuid4().hex
        all_tags = dict(tags or {})
        all_tags.setdefault("mlflow.runName", run_name)
        self.runs[run_id] = {
            "info": {
                "run_uuid": run_id,
                "run_id": run_id,
                "run_name": run_name,
                "experiment_id": experiment_id,
                "user_id": user_id,
                "status": "RUNNING",
                "start_time": start_time if start_time is not None else _now_ms(),
                "artifact_uri": f"{experiment['artifact_location']}/{run_id}/artifacts",
                "lifecycle_stage": "active",
            },
            "data": {"tags": [{"key": k, "value": v} for k, v in all_tags.items()]},
            "inputs": {},
            "outputs": {},
        }
        return run_id

    # --- what a test reads ---

    def paths(self) -> list[str]:
        """Every request as "METHOD path", in order."""
        return [f"{r.method} {r.path}" for r in self.requests]

    def unknown(self) -> list[str]:
        """Requests to routes this fake does not serve."""
        return [f"{r.method} {r.path}" for r in self.requests if r.body == "<unknown route>"]

    def received_spans(self) -> list[ReceivedSpan]:
        """Every span of every accepted OTLP post, repeats included."""
        return [span for export in self.exports for span in export.spans]

    def run_by_name(self, experiment_id: str, name: str) -> dict[str, Any]:
        [run] = [
            r
            for r in self.runs.values()
            if r["info"]["experiment_id"] == experiment_id and r["info"]["run_name"] == name
        ]
        return run

    def fail(self, route: str, status: int) -> None:
        """Answer `route` ("METHOD /path", as in `paths()`) with `status` and MLflow's error
        JSON, until `recover`."""
        self.failing[route] = status

    def recover(self) -> None:
        self.failing.clear()

    # --- serving ---

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/version", self._version)
        app.router.add_get(f"{API}/experiments/get-by-name", self._json(self._get_by_name))
        app.router.add_post(f"{API}/experiments/create", self._json(self._create_experiment))
        app.router.add_get(f"{API}/runs/get", self._json(self._get_run))
        app.router.add_post(f"{API}/runs/search", self._json(self._search_runs))
        app.router.add_post(f"{API}/runs/create", self._json(self._create_run))
        app.router.add_post(f"{API}/runs/update", self._json(self._update_run))
        app.router.add_post(f"{API}/runs/log-batch", self._json(self._log_batch))
        app.router.add_post(f"{API}/traces/link-to-run", self._json(self._link_traces))
        app.router.add_get(
            API3 + "/traces/{trace_id:tr-[0-9a-f]{32}}", self._json(self._trace_info)
        )
        app.router.add_patch(
            API + "/traces/{trace_id:tr-[0-9a-f]{32}}/tags", self._json(self._set_trace_tag)
        )
        app.router.add_post(OTLP, self._otlp)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        async with serve_app(self.app()) as url:
            yield url

    def _recorded(self, request: web.Request, body: Any) -> Recorded:
        recorded = Recorded(
            request.method, request.path, dict(request.query), dict(request.headers), body
        )
        self.requests.append(recorded)
        return recorded

    def _failure(self, request: web.Request) -> web.Response | None:
        status = self.failing.get(f"{request.method} {request.path}")
        if status is None:
            return None
        code = _STATUS_ERROR.get(status, "INTERNAL_ERROR")
        return web.json_response(
            {"error_code": code, "message": f"fake failure ({status})"}, status=status
        )

    def _json(
        self, handler: Callable[[dict[str, Any], web.Request], dict[str, Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """A REST route: the request message from the query (GET) or the JSON body."""

        async def route(request: web.Request) -> web.Response:
            if request.method == "GET":
                body: dict[str, Any] = dict(request.query)
            else:
                raw = await request.read()
                body = json.loads(raw) if raw else {}
            recorded = self._recorded(request, body)
            response = self._failure(request)
            if response is None:
                try:
                    response = web.json_response(handler(body, request))
                except ApiError as exc:
                    response = exc.response()
            recorded.status = response.status
            return response

        return route

    async def _version(self, request: web.Request) -> web.Response:
        recorded = self._recorded(request, None)
        response = self._failure(request) or web.Response(text=VERSION)
        recorded.status = response.status
        return response

    async def _unknown(self, request: web.Request) -> web.Response:
        await request.read()
        recorded = self._recorded(request, "<unknown route>")
        recorded.status = 404
        return web.json_response(
            {"error_code": "ENDPOINT_NOT_FOUND", "message": f"not faked: {request.path}"},
            status=404,
        )

    # --- experiments and runs ---

    def _get_by_name(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        name = _required(body, "experiment_name")
        for experiment in self.experiments.values():
            if experiment["name"] == name:
                return {"experiment": experiment}
        raise ApiError("RESOURCE_DOES_NOT_EXIST", f"Could not find experiment with name '{name}'")

    def _create_experiment(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        experiment_id = self.add_experiment(_required(body, "name"))
        if body.get("artifact_location"):
            self.experiments[experiment_id]["artifact_location"] = body["artifact_location"]
        if body.get("tags"):
            self.experiments[experiment_id]["tags"] = body["tags"]
        return {"experiment_id": experiment_id}

    def _run(self, body: dict[str, Any]) -> dict[str, Any]:
        run_id = body.get("run_id") or body.get("run_uuid")
        if not run_id:
            raise ApiError(
                "INVALID_PARAMETER_VALUE", "Missing value for required parameter 'run_id'."
            )
        run = self.runs.get(run_id)
        if run is None:
            raise ApiError("RESOURCE_DOES_NOT_EXIST", f"Run with id={run_id} not found")
        return run

    def _get_run(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        return {"run": self._run(body)}

    def _create_run(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        tags = {t["key"]: t.get("value", "") for t in body.get("tags") or []}
        name = body.get("run_name") or tags.get("mlflow.runName") or f"run-{len(self.runs)}"
        run_id = self.add_run(
            str(body.get("experiment_id", "0")),
            name,
            tags=tags,
            user_id=body.get("user_id", ""),
            start_time=int(body.get("start_time") or _now_ms()),
        )
        return {"run": self.runs[run_id]}

    def _update_run(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        info = self._run(body)["info"]
        if body.get("status") is not None:
            info["status"] = body["status"]
        if body.get("end_time") is not None:
            info["end_time"] = int(body["end_time"])
        if body.get("run_name"):
            info["run_name"] = body["run_name"]
        return {"run_info": info}

    def _search_runs(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        experiment_ids = [str(e) for e in body.get("experiment_ids") or []]
        view = body.get("run_view_type", "ACTIVE_ONLY")
        stages = {"ACTIVE_ONLY": {"active"}, "DELETED_ONLY": {"deleted"}}.get(
            view, {"active", "deleted"}
        )
        name: str | None = None
        if body.get("filter"):
            match = _RUN_NAME_FILTER.fullmatch(body["filter"])
            if match is None:
                raise ApiError("INVALID_PARAMETER_VALUE", f"filter not faked: {body['filter']}")
            name = match["s"] if match["s"] is not None else match["d"]
        for order in body.get("order_by") or []:
            if _START_TIME_DESC.fullmatch(order) is None:
                raise ApiError("INVALID_PARAMETER_VALUE", f"order_by not faked: {order}")
        found = [
            run
            for run in self.runs.values()
            if run["info"]["experiment_id"] in experiment_ids
            and run["info"]["lifecycle_stage"] in stages
            and (name is None or run["info"]["run_name"] == name)
        ]
        found.sort(key=lambda r: (-r["info"]["start_time"], r["info"]["run_id"]))
        return {"runs": found[: int(body.get("max_results", 1000))]}

    def _log_batch(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        run = self._run(body)
        for index, metric in enumerate(body.get("metrics") or []):
            for name in ("key", "value", "timestamp"):
                if metric.get(name) is None:
                    raise ApiError(
                        "INVALID_PARAMETER_VALUE",
                        f"Missing value for required parameter 'metrics[{index}].{name}'.",
                    )
            self.metrics.setdefault(run["info"]["run_id"], []).append(
                {
                    **metric,
                    "step": int(metric.get("step", 0)),
                    "timestamp": int(metric["timestamp"]),
                }
            )
        return {}

    # --- traces ---

    def _link_traces(self, body: dict[str, Any], _: web.Request) -> dict[str, Any]:
        trace_ids = _required(body, "trace_ids")
        run_id = _required(body, "run_id")
        if len(trace_ids) > LINKS_PER_REQUEST:
            raise ApiError(
                "INVALID_PARAMETER_VALUE",
                f"Cannot link more than {LINKS_PER_REQUEST} traces to a run in a single "
                f"request. Provided {len(trace_ids)} traces.",
            )
        self._link(run_id, trace_ids)
        return {}

    def _link(self, run_id: str, trace_ids: list[str]) -> None:
        linked = self.links.setdefault(run_id, [])
        linked.extend(t for t in trace_ids if t not in linked)

    def _trace(self, request: web.Request) -> StoredTrace:
        trace_id = request.match_info["trace_id"]
        trace = self.traces.get(trace_id)
        if trace is None:
            raise ApiError("RESOURCE_DOES_NOT_EXIST", f"Trace with ID '{trace_id}' not found.")
        return trace

    def _trace_info(self, _: dict[str, Any], request: web.Request) -> dict[str, Any]:
        return {"trace": {"trace_info": self._trace(request).info_json()}}

    def _set_trace_tag(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        key = _required(body, "key")
        self._trace(request).tags[key] = str(body.get("value", ""))
        return {}

    async def _otlp(self, request: web.Request) -> web.Response:
        raw = await request.read()
        headers = dict(request.headers)
        recorded = self._recorded(request, None)
        response = self._failure(request) or self._ingest(request, raw, headers, recorded)
        recorded.status = response.status
        return response

    def _ingest(
        self, request: web.Request, raw: bytes, headers: dict[str, str], recorded: Recorded
    ) -> web.Response:
        def detail(status: int, message: Any) -> web.Response:
            return web.json_response({"detail": message}, status=status)

        media_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if media_type not in ("application/x-protobuf", "application/json"):
            return detail(400, f"Invalid Content-Type: {media_type}.")
        experiment_id = request.headers.get(EXPERIMENT_HEADER)
        if experiment_id is None:
            return detail(
                422,
                [
                    {
                        "type": "missing",
                        "loc": ["header", EXPERIMENT_HEADER],
                        "msg": "Field required",
                    }
                ],
            )
        message = ExportTraceServiceRequest()
        try:
            if media_type == "application/json":
                data = json.loads(raw)
                for resource_spans in data.get("resourceSpans", []):
                    for scope_spans in resource_spans.get("scopeSpans", []):
                        for span in scope_spans.get("spans", []):
                            for name in ("traceId", "spanId", "parentSpanId"):
                                if span.get(name):  # hex in OTLP JSON, base64 in proto JSON
                                    span[name] = base64.b64encode(
                                        bytes.fromhex(span[name])
                                    ).decode()
                ParseDict(data, message, ignore_unknown_fields=True)
            else:
                message.ParseFromString(raw)
        except (DecodeError, ValueError):
            return detail(400, "Invalid OpenTelemetry format")
        if not message.resource_spans:
            return detail(400, "Invalid OpenTelemetry format - no spans found")
        if experiment_id not in self.experiments:
            return ApiError(
                "RESOURCE_DOES_NOT_EXIST", f"No Experiment with id={experiment_id} exists"
            ).response()

        spans: list[ReceivedSpan] = []
        resource: dict[str, Any] = {}
        for resource_spans in message.resource_spans:
            resource.update(
                {a.key: decode_any_value(a.value) for a in resource_spans.resource.attributes}
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if not span.trace_id or not span.span_id:
                        return detail(422, "Cannot convert OpenTelemetry span to MLflow span")
                    spans.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex() or None,
                            name=span.name,
                            start_time_unix_nano=span.start_time_unix_nano,
                            end_time_unix_nano=span.end_time_unix_nano,
                            status_code=Status.StatusCode.Name(span.status.code),
                            status_message=span.status.message,
                            attributes={a.key: decode_any_value(a.value) for a in span.attributes},
                            events=[
                                {
                                    "name": e.name,
                                    "time_unix_nano": e.time_unix_nano,
                                    "attributes": {
                                        a.key: decode_any_value(a.value) for a in e.attributes
                                    },
                                }
                                for e in span.events
                            ],
                        )
                    )
        export = OtlpExport(headers=headers, resource=resource, spans=spans)
        recorded.body = export
        self.exports.append(export)
        self._store(experiment_id, spans, headers.get(RUN_HEADER))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def _store(self, experiment_id: str, spans: list[ReceivedSpan], run_id: str | None) -> None:
        by_trace: dict[str, list[ReceivedSpan]] = {}
        for span in spans:
            self.spans[(span.mlflow_trace_id, span.span_id)] = span
            by_trace.setdefault(span.mlflow_trace_id, []).append(span)
        completed = []
        for trace_id, batch in by_trace.items():
            start_ms = min(s.start_time_unix_nano for s in batch) // 1_000_000
            ends = [s.end_time_unix_nano for s in batch if s.end_time_unix_nano]
            end_ms = max(ends) // 1_000_000 if ends else None
            roots = [s for s in batch if s.parent_span_id is None]
            trace = self.traces.get(trace_id)
            if trace is None:
                trace = self.traces[trace_id] = StoredTrace(
                    trace_id=trace_id,
                    experiment_id=experiment_id,
                    request_time_ms=start_ms,
                    duration_ms=None,
                    state="IN_PROGRESS",
                )
            trace.request_time_ms = min(trace.request_time_ms, start_ms)
            if end_ms is not None:
                trace.duration_ms = end_ms - trace.request_time_ms
            for root in roots:
                completed.append(trace_id)
                trace.state = "ERROR" if root.status_code == "STATUS_CODE_ERROR" else "OK"
                for key, value in root.attributes.items():
                    if key.startswith(TAG_PREFIX):
                        trace.tags[key.removeprefix(TAG_PREFIX)] = str(value)
        if run_id and completed:
            self._link(run_id, completed)
