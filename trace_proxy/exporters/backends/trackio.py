"""The trackio backend: one `trackio.Trace` per trajectory, in a local trackio project.

What verl's rollout trace logs with `backend=trackio`, re-created from the proxy's records:
`run.log({"rollout_trace/agent_loop": trackio.Trace(messages, metadata, spans)}, step=step)`
in the run named after the experiment. `trackio show --project P` then lists the traces per
step, with the conversation, the execution tree and the metadata (reward, key, token counts).

- Storage: `$TRACKIO_DIR/<project>.db` (`--trackio-dir`; else `TRACKIO_DIR`, else trackio's
  default `~/.cache/huggingface/trackio`). trackio reads TRACKIO_DIR once, when it is imported,
  so a process holds one directory: a second exporter asking for another one is refused.
- Names: a record's project comes from a request, and trackio names files after it (the
  database, its lock, trace session and media directories). trackio 0.43 keeps only letters,
  digits, `-` and `_` of it, so it cannot leave TRACKIO_DIR, but it keeps any length (a name
  too long for a file stalled the backend) and non-ASCII letters (which a filesystem may
  normalise), and `../..` fell into its `default` project. So trackio gets the project's
  `store_name`, as the jsonl store names its directory: ordinary names are unchanged, others
  are percent-encoded (trackio then drops the `%`), long ones cut and hashed; the trace's
  metadata keeps the project as sent. The run is named after the experiment as sent: trackio
  keeps run names in its database and uses one in a path only for media (never logged here)
  and, reduced to `[A-Za-z0-9._-]` and 100 characters, for its trace session files.
- Runs: one per (project, experiment), created on first use with `trackio.init(project,
  name=experiment)` and finished by `close()`. `trackio.init` keeps "the current run" in a
  context variable and finishes the previous one, so each run is created in a context of its
  own and logged through its `Run` object (module-level `trackio.log` does not work from the
  export thread). A restarted proxy starts a new run with the same name (`resume="never"`):
  resuming would overwrite the run's config, which may be the trainer's own.
- Open runs are bounded: each holds a writer thread, and requests can name any number of
  experiments, so at most `max_open_runs` (16) stay open; the least recently used one is
  finished (its traces are already written) and reopened when needed again. A reopened run
  continues under its id (`trackio.Run(run_id=...)`, as `trackio.init` builds one), not through
  `trackio.init(resume="allow")`, which takes the newest run of that name: the trainer's own when
  it logs to the same project under the experiment's name (verl does), whose config it would
  overwrite. The ids of the latest 4,096 runs made here are remembered; a run forgotten by then
  is started again as a new run of the same name. A batch naming more runs than may be open is
  written a few runs at a time, so a failure there may log the runs already written again.
- Step: the trajectory's step; trajectories without one are logged at step 0 with
  `metadata.step = None`. Validation trajectories share the step and carry `validate: true`.
- Messages, the whole multi-turn conversation: for chat dialects the last call's full messages
  and its response; for token dialects the messages the SFT export gives the same record, read
  from the decoded text by `text.conversation` with `--tool-parser`: the first prompt's
  turns, each answer with its `tool_calls` named after the tool spans, and every turn a later
  prompt adds (tool results as `role: tool` messages, the user's next question); text in no
  chat template the parser knows is a user message marked `unparsed`. Members without a value
  are left out. Without decoded text: the first prompt (or a note that it was not decoded) and
  the server's answers. The dashboard previews the first assistant message, so one that only
  calls tools gets the calls written out as its content.
- Spans: a root `agent_loop` span for the trajectory, a `generation` span per generate call
  (model, usage, what the call added to the prompt, the response) and a `tool` span per tool
  call, all children of the root, with ISO-8601 times and `duration_ms`.
- Late rewards (`annotation` records) are logged as metadata-only traces (no messages) under
  `rollout_trace/annotation` at the step they belong to. Step events and step summaries are not
  exported to trackio.

trackio writes in a background thread of each run (every 0.5 s) and only warns when a write
fails, so an export never raises for storage errors; `export()` writes the batch itself before
it returns (`_persist`), so the spool's cursor never moves past a trace still in memory;
`close()` finishes the runs. A record trackio cannot take (a project name it reserves, such as
`registry-*` or one ending in `_traces`; a record that cannot be rendered) is rejected: dropped
and counted (`export_dropped{reason="rejected"}`), never counted as exported.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from trace_proxy.exporters.backends.spans import (
    ROOT_NAME,
    Generation,
    Tool,
    TrajectorySpans,
    duration_ms,
    error_text,
    trajectory_spans,
    utc,
)
from trace_proxy.exporters.base import Exporter, ExportRejected
from trace_proxy.store.names import store_name
from trace_proxy.text.conversation import token_messages
from trace_proxy.text.toolparsers import DEFAULT_PARSER, ToolCallParser, get_parser
from trace_proxy.trajectories.record import KEY_FIELDS, Annotation, Record, Trajectory, dumps

log = logging.getLogger(__name__)

TRACE_KEY = f"rollout_trace/{ROOT_NAME}"  # verl's key: `rollout_trace/` and the op's name
ANNOTATION_KEY = "rollout_trace/annotation"
JSON = dict[str, Any]
MAX_OPEN_RUNS = 16  # runs open at once, each with a writer thread of its own
REMEMBERED = 4096  # ids of runs made here (to reopen them), and projects trackio refuses
Where = tuple[str, str]  # (trackio project, run name)


class TrackioExporter(Exporter):
    name = "trackio"

    def __init__(
        self,
        project: str,
        directory: Path | None = None,
        *,
        max_open_runs: int = MAX_OPEN_RUNS,
        tool_parser: ToolCallParser | None = None,
    ) -> None:
        """`project`: where records that name no project go (records keep the project of
        their key, as in the jsonl store); `directory`: trackio's TRACKIO_DIR; `tool_parser`:
        how decoded text writes turns and tool calls (token2text's, `--tool-parser`)."""
        self.tool_parser = tool_parser or get_parser(DEFAULT_PARSER)
        self._trackio = _import_trackio(directory)
        from trackio.sqlite_storage import SQLiteStorage

        self._storage = SQLiteStorage
        self.project = project
        self.directory = Path(self._trackio.utils.TRACKIO_DIR)
        self.max_open_runs = max(1, max_open_runs)
        self._runs: OrderedDict[Where, Any] = OrderedDict()  # open, least recently used first
        self._run_ids: OrderedDict[Where, str] = OrderedDict()  # runs made here, newest last
        self._refused: OrderedDict[str, None] = OrderedDict()  # projects trackio refuses

    def export(self, records: list[Record]) -> None:
        logged: dict[Where, list[tuple[int, str, Any]]] = {}  # by run, in record order
        rejected: list[str] = []  # why, for each record trackio cannot take
        for record in records:
            if isinstance(record, Trajectory):
                key = record.key
                where = (store_name(key.project or self.project), key.experiment)
                step, name = key.step, TRACE_KEY
            elif isinstance(record, Annotation):
                where = (store_name(record.project or self.project), record.experiment)
                step, name = record.step, ANNOTATION_KEY
            else:
                continue  # step events and step summaries: not exported to trackio
            if not self._valid_project(where[0]):
                rejected.append(f"trackio refuses the project name {where[0]!r}")
                continue
            try:
                trace = self._trace(record)
            except Exception as exc:  # a record this code cannot render: retrying will not help
                log.exception("trackio: could not render record %s", _record_id(record))
                rejected.append(f"record {_record_id(record)} cannot be rendered: {exc!r}")
                continue
            logged.setdefault(where, []).append((0 if step is None else step, name, trace))
        if rejected:  # before anything is logged: the pipeline sends the others one by one
            raise ExportRejected(f"trackio: {len(rejected)} of {len(records)} records cannot be "
                                 f"exported; {rejected[0]}")  # fmt: skip
        # Every run first: a failure raises before anything is logged, so a retry repeats nothing
        # (a batch naming more runs than may be open: for each part of it).
        places = list(logged)
        for first in range(0, len(places), self.max_open_runs):
            part = places[first : first + self.max_open_runs]
            runs = [self._run(*where) for where in part]
            for where, run in zip(part, runs, strict=True):
                for step, name, trace in logged[where]:
                    run.log({name: trace}, step=step)
            for run in runs:
                _persist(run)

    def close(self) -> None:
        runs, self._runs = self._runs, OrderedDict()
        for run in runs.values():
            run.finish()  # waits for the run's writer thread

    def _valid_project(self, project: str) -> bool:
        if project in self._refused:
            self._refused.move_to_end(project)
            return False
        try:
            self._storage.validate_project_name(project)
            database = os.path.realpath(self._storage.get_project_db_path(project))
            directory = os.path.realpath(self.directory)
            if os.path.commonpath([directory, database]) != directory:  # never, in trackio 0.43
                raise ValueError(f"its database {database} would be outside {directory}")
        except ValueError as exc:
            _remember(self._refused, project, None)
            log.error("trackio: records of project %r are not exported: %s", project, exc)
            return False
        return True

    def _run(self, project: str, experiment: str) -> Any:
        """The open run of (project, experiment): opened, reopened or made as needed, after
        finishing the least recently used ones beyond the bound."""
        where = (project, experiment)
        run = self._runs.get(where)
        if run is not None:
            self._runs.move_to_end(where)
            return run
        while len(self._runs) >= self.max_open_runs:
            _, oldest = self._runs.popitem(last=False)
            oldest.finish()  # its traces are written (`_persist`): stops its writer thread
        config = {"logged_by": "trace-proxy", "experiment_name": experiment}
        run_id = self._run_ids.get(where)
        if run_id is not None:  # reopened: the same run, by id (see the module's docstring)
            run = self._trackio.Run(
                url=None, project=project, client=None, name=experiment, run_id=run_id,
                config=config, auto_log_cpu=False, auto_log_gpu=False,
            )  # fmt: skip
        else:
            # A context of its own: trackio.init finishes the context's current run otherwise.
            run = contextvars.Context().run(
                self._trackio.init,
                project=project,
                name=experiment,
                config=config,
                resume="never",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
            log.info("trackio: traces go to run %r of project %r; view them with: "
                     "TRACKIO_DIR=%s trackio show --project %s", experiment, project,
                     self.directory, project)  # fmt: skip
        self._runs[where] = run
        _remember(self._run_ids, where, str(run.id))
        return run

    def _trace(self, record: Trajectory | Annotation) -> Any:
        data: JSON = orjson.loads(dumps(record))
        if isinstance(record, Annotation):
            return self._trackio.Trace([], metadata=annotation_metadata(data))
        messages, spans, metadata = render_trajectory(data, self.tool_parser)
        return self._trackio.Trace(messages, metadata=metadata, spans=spans)


@dataclass(frozen=True)
class TrackioConfig:
    """What the trackio backend is told: `--project` (of records that name none),
    `--trackio-dir` (None: TRACKIO_DIR, else trackio's own default) and `--tool-parser`."""

    project: str
    directory: Path | None = None
    tool_parser: str = DEFAULT_PARSER


def create(config: TrackioConfig) -> TrackioExporter:
    return TrackioExporter(
        config.project, config.directory, tool_parser=get_parser(config.tool_parser)
    )


def _import_trackio(directory: Path | None) -> Any:
    """trackio, with TRACKIO_DIR = `directory` (read by trackio once, at import)."""
    if directory is not None:
        directory = Path(directory).expanduser().absolute()
        if "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = str(directory)
    try:
        import trackio
        import trackio.utils
    except ImportError as exc:
        raise ImportError(
            "the trackio backend needs trackio: pip install 'trace-proxy[trackio]'"
        ) from exc
    current = Path(trackio.utils.TRACKIO_DIR).expanduser().absolute()
    if directory is not None and current != directory:
        raise RuntimeError(
            f"trackio already keeps its data in {current} in this process (it reads TRACKIO_DIR "
            f"once, when imported), so it cannot also use {directory}"
        )
    return trackio


# --- rendering ---------------------------------------------------------------------------------


def render_trajectory(
    data: JSON, parser: ToolCallParser | None = None
) -> tuple[list[JSON], list[JSON], JSON]:
    """(messages, spans, metadata) of a trajectory in its JSON form; `parser` reads the
    decoded text of token-in calls (the `--tool-parser` token2text used; hermes if None)."""
    view = trajectory_spans(data)
    if view.calls and view.calls[-1].prompt.get("messages") is not None:
        messages = chat_messages(view.calls[-1])
    else:
        messages = token_conversation(data, view, parser or get_parser(DEFAULT_PARSER))
    ensure_visible_first_answer(messages)
    return messages, spans_of(view), trajectory_metadata(view)


def chat_messages(last: Generation) -> list[JSON]:
    """The last call's full messages and its response."""
    messages = [dict(m) for m in last.prompt.get("messages") or [] if isinstance(m, dict)]
    if last.outputs:
        messages.append(assistant_message(last.outputs[0]))
    return messages


def assistant_message(output: JSON, text: str | None = None) -> JSON:
    message: JSON = {"role": "assistant", "content": output.get("text") if text is None else text}
    if output.get("tool_calls"):
        message["tool_calls"] = output["tool_calls"]
    if output.get("reasoning"):
        message["reasoning"] = output["reasoning"]
    return message


def token_conversation(data: JSON, view: TrajectorySpans, parser: ToolCallParser) -> list[JSON]:
    """The conversation from decoded text, read as the SFT export reads it
    (`text.conversation`): every turn each prompt adds, each answer with its tool calls
    named after the tool spans; a message's empty members left out. Without decoded text: the
    first prompt (or a note that it was not decoded) and the answers as the server gave them."""
    messages = token_messages(data, parser)
    if messages is not None:
        return [
            {name: value for name, value in m.items() if value is not None and value is not False}
            for m in messages
        ]
    if not view.calls:
        return []
    undecoded: list[JSON] = [{"role": "user", "content": _full_prompt_text(view.calls[0])}]
    undecoded += [
        assistant_message(c.outputs[0], _output_text(c.outputs[0])) for c in view.calls if c.outputs
    ]
    return undecoded


def _full_prompt_text(call: Generation) -> str:
    if call.prompt_piece is not None and not call.stored_prompt.get("prefix_len"):
        return str(call.prompt_piece)
    if call.prompt.get("text") is not None:
        return str(call.prompt["text"])
    return f"[{call.prompt_tokens} prompt tokens, not decoded: run the proxy with --token2text]"


def _output_text(output: JSON) -> str | None:
    text = output.get("response_text")
    if text is None:
        text = output.get("text")
    return None if text is None else str(text)


def _tool_call_id(span: Tool) -> str:
    return str(span.call_id or f"call-{span.index}")


def ensure_visible_first_answer(messages: list[JSON]) -> None:
    """The trace list previews the first assistant message's content: one that only calls
    tools (content null) gets its calls written out, `name(arguments)` a line."""
    first = next((m for m in messages if m.get("role") == "assistant"), None)
    if first is None or _visible(first.get("content")):
        return
    calls = [c.get("function") or {} for c in first.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        first["content"] = "\n".join(f"{c.get('name')}({c.get('arguments') or ''})" for c in calls)
    elif first.get("reasoning") or first.get("reasoning_content"):
        reasoning = first.get("reasoning") or first.get("reasoning_content")
        first["content"] = f"(reasoning only) {reasoning}"
    else:
        first["content"] = "(empty response)"


def _visible(content: Any) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(
            isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"].strip()
            for p in content
        )
    return False


# --- spans -------------------------------------------------------------------------------------


def iso(seconds: float | None) -> str | None:
    return None if seconds is None else utc(seconds).isoformat()


def _timed(start: float | None, end: float | None) -> JSON:
    return {"start_time": iso(start), "end_time": iso(end), "duration_ms": duration_ms(start, end)}


def spans_of(view: TrajectorySpans) -> list[JSON]:
    root = view.root
    root_id = str(root.record_id)
    key = root.key
    failed = view.failed
    spans: list[JSON] = [{
        "id": root_id,
        "name": ROOT_NAME,
        "kind": "span",
        "parent_id": None,
        **_timed(root.start, root.end),
        "status": "error" if root.status == "error" else "success",
        "error": error_text(failed[0].error) if failed else None,
        "input": {k: key.get(k) for k in KEY_FIELDS},
        "output": {"reward": root.reward, "score": root.score, "labels": root.labels,
                   "close_reason": root.close_reason},
        "model": None,
        "usage": _usage_totals(root.summary or {}),
        "metadata": {
            "record_id": root.record_id,
            "part": root.part,
            "upstreams": root.upstreams,
            "key_sources": key.get("sources"),
            "annotations": root.annotations,
        },
    }]  # fmt: skip
    spans.extend(_generation_span(root_id, call, view.root.lag_of(call)) for call in view.calls)
    spans.extend(_tool_span(root_id, tool) for tool in view.tools)
    return spans


def _generation_span(root_id: str, call: Generation, lag: int | None) -> JSON:
    dialect = str(call.dialect)
    rendered = [_generation_output(o) for o in call.outputs]
    return {
        "id": f"{root_id}/{call.id}",
        "name": f"{call.declared.operations.trackio} {call.model or ''}".strip(),
        "kind": "generation",
        "parent_id": root_id,
        **_timed(call.start, call.end),
        "status": "error" if call.error else "success",
        "error": error_text(call.error),
        "input": _generation_input(call),
        "output": rendered[0] if len(rendered) == 1 else (rendered or None),
        "model": call.model,
        "usage": call.usage,
        "metadata": {
            "index": call.index,
            "dialect": dialect,
            "route": call.route,
            "upstream": call.upstream,
            "request_id": call.request_id,
            "http_status": call.http_status,
            "stream": call.stream,
            "ttft_ms": duration_ms(call.start, call.first_byte),
            "weight_version": call.weight_version,
            "version_lag": lag,
            "sampling": call.sampling,
            "unparsed": call.unparsed,
            "segments": call.segments,
        },
    }


def _generation_input(call: Generation) -> JSON:
    """What this call added to the conversation (the whole of it is the trace's messages)."""
    prompt = call.stored_prompt
    shared = {"prefix_call": prompt.get("prefix_call"), "prefix_len": prompt.get("prefix_len")}
    if prompt.get("prefix_reply") is not None:  # the previous reply, shared rather than stored
        shared["prefix_reply"] = prompt["prefix_reply"]
    if prompt.get("messages") is not None:
        return {"messages": prompt["messages"], **shared}
    text = call.prompt_piece
    if text is None:
        text = prompt.get("text")
    if text is not None:
        return {"text": text, **shared}
    return {"token_count": len(prompt.get("token_ids") or []), **shared}


def _generation_output(output: JSON) -> JSON:
    rendered: JSON = {"text": _output_text(output), "finish_reason": output.get("finish_reason")}
    for name in ("tool_calls", "reasoning", "stop_reason"):
        if output.get(name) is not None:
            rendered[name] = output[name]
    if output.get("token_ids") is not None:
        rendered["token_count"] = len(output["token_ids"])
    return rendered


def _tool_span(root_id: str, tool: Tool) -> JSON:
    status = "error" if tool.error else ("success" if tool.result is not None else None)
    return {
        "id": f"{root_id}/{tool.id}",
        "name": f"execute_tool {tool.name or '?'}",
        "kind": "tool",
        "parent_id": root_id,
        **_timed(tool.start, tool.end),
        "status": status,
        "error": error_text(tool.error),
        "input": tool.parsed_arguments,
        "output": tool.result,
        "model": None,
        "usage": None,
        "metadata": {
            "index": tool.index,
            "observed": tool.observed,
            "call_id": _tool_call_id(tool),
            "requested_by": tool.requested_by,
            "raw": tool.raw,
            "route": tool.route,
            "upstream": tool.upstream,
            "http_status": tool.http_status,
        },
    }


def _usage_totals(summary: JSON) -> JSON | None:
    if "prompt_tokens" not in summary and "completion_tokens" not in summary:
        return None
    prompt, completion = summary.get("prompt_tokens") or 0, summary.get("completion_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


# --- metadata ----------------------------------------------------------------------------------


def trajectory_metadata(view: TrajectorySpans) -> JSON:
    root = view.root
    key = root.key
    summary = root.summary or {}
    calls = view.calls
    return {
        "trajectory_id": key.get("trajectory_id"),
        "project": key.get("project"),
        "experiment_name": key.get("experiment"),
        "step": key.get("step"),
        "sample_index": key.get("sample_index"),
        "rollout_n": key.get("rollout_n"),
        "validate": key.get("validate"),
        "sample_hash": key.get("sample_hash"),
        "reward": root.reward,
        "score": root.score,
        "labels": root.labels,
        "status": "error" if root.status == "error" else "success",
        "close_reason": root.close_reason,
        "weight_versions": root.weight_versions,
        **root.policy_fields(),
        "model": next((c.model for c in reversed(calls) if c.model), None),
        "num_turns": summary.get("calls", len(calls)),
        "num_tool_calls": summary.get("tool_calls"),
        "num_errors": summary.get("errors"),
        "calls_dropped": summary.get("calls_dropped"),
        "prompt_tokens": summary.get("prompt_tokens"),
        "completion_tokens": summary.get("completion_tokens"),
        "duration_ms": duration_ms(root.start, root.end),
        "record_id": root.record_id,
        "part": root.part,
    }


def annotation_metadata(data: JSON) -> JSON:
    target = data.get("target") or {}
    return {
        "record": "annotation",
        "trajectory_id": target.get("trajectory_id"),
        "target": target,
        "applies_to": data.get("trajectories"),
        "project": data.get("project"),
        "experiment_name": data.get("experiment"),
        "step": data.get("step"),
        "validate": data.get("validate"),
        "reward": data.get("reward"),
        "score": data.get("score"),
        "labels": data.get("labels"),
        "time": iso(data.get("time")),
    }


def _persist(run: Any) -> None:
    """Write what the run has queued now, as its writer thread would (trackio 0.43 internals:
    `_client_lock`, `_flush_queues_inline`), so that a record counts as exported only once it
    is in the database: the spool's cursor moves past it right after. Without those
    internals, trackio's thread writes it within 0.5 s."""
    lock, flush = getattr(run, "_client_lock", None), getattr(run, "_flush_queues_inline", None)
    if lock is not None and flush is not None:
        with lock:
            flush()


def _remember(latest: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """`latest[key] = value`, newest last, keeping the latest `REMEMBERED` entries."""
    latest[key] = value
    latest.move_to_end(key)
    while len(latest) > REMEMBERED:
        latest.popitem(last=False)


def _record_id(record: Record) -> str:
    return str(getattr(record, "id", None) or getattr(record, "target", "?"))
