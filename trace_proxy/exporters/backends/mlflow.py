"""MLflow backend: one trace per trajectory, in the project's experiment, linked to a run.

A trajectory becomes a trace (built by `mlflow_traces.py`, pure) whose root span `agent_loop`
(AGENT) has one child per generate
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

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trace_proxy.exporters.backends.mlflow_names import (
    MAX_EXPERIMENT_TAG_VALUE,
    NAME_DIGEST_TAG,
    PROJECT_TAG,
    literal,
    substitute,
)
from trace_proxy.exporters.base import Exporter, ExportRejected
from trace_proxy.store.names import digest
from trace_proxy.trajectories.record import Annotation, Record, StepSummary, Trajectory

# Before MLflow is imported: a proxy never phones home; MLFLOW_DISABLE_TELEMETRY=false overrides.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# ImportError without the extra: the backend registry says `pip install 'trace-proxy[mlflow]'`.
from mlflow.entities import (
    Metric,
    Span,
    TraceData,
    TraceInfo,
    TraceLocation,
    TraceState,
)
from mlflow.exceptions import MlflowException, RestException
from mlflow.store.tracking.rest_store import RestStore
from mlflow.tracing.client import TracingClient
from mlflow.tracking import MlflowClient

from trace_proxy.exporters.backends.mlflow_traces import (
    HEX32,
    TraceRecord,
    outcome_tags,
    render,
    to_mlflow_spans,
    trace_id_of,
)

log = logging.getLogger(__name__)

LINKS_PER_CALL = 100  # MLflow's limit for link_traces_to_run
SPANS_PER_CALL = 500  # spans per log_spans request
_NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"
# MLflow's answer to a request that is invalid as it is: retrying the same record cannot help.
REFUSED = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})
MAX_EXPERIMENT_NAME = 500  # MLflow refuses longer experiment names
MAX_RUN_NAME = 250  # the run table's name column (PostgreSQL and MySQL refuse longer names)
# Experiments and runs looked up, kept for the next records naming them: requests can name any
# number. One forgotten is looked up again; a run created here is ended when forgotten.
REMEMBERED = 4096


class MlflowExporter(Exporter):
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
        if self.run is not None and HEX32.fullmatch(self.run):
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
