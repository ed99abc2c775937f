"""`trace-proxy show DIR`: the jsonl store, readable in a terminal.

One header line per trajectory (its key, status, size, duration), then one line per call: what
was asked (the newest message, or decoded prompt text) and what came back (text, tool calls).
Several stores (one per replica, each sidecar writing its own) read as one: the records of the
same project and experiment are shown together, ordered by step and sample across the stores,
and each step's summaries add up to one. An output whose proxies wrote replica directories
(`<output>/replicas/*`, see store/replicas.py) is such a set of stores.

Nearly every string of a record came from a request or a response (names, ids, models, routes,
tool calls, error messages, labels), so every line goes through `printable` on its way out:
an escape sequence in a project name is shown as `\x1b[...`, never acted on by the terminal.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from trace_proxy.exporters.leftovers import leftovers, notice
from trace_proxy.logtext import printable
from trace_proxy.store.annotations import apply_annotations
from trace_proxy.store.readers import iter_records, run_records, runs
from trace_proxy.store.replicas import merged_summary, one_per_trajectory, store_roots
from trace_proxy.trajectories.prompts import expand_prompts

# a store's records one by one, and the command (its options, and run from them)
__all__ = ["add_show_command", "iter_records", "run_show_command", "show"]


def add_show_command(commands: Any) -> None:
    """Register `trace-proxy show DIRECTORY ... [--step N] [--experiment NAME] ...`."""
    parser = commands.add_parser("show", help="print stored trajectories readably")
    parser.add_argument(
        "directory",
        nargs="+",
        help="the --output directory of serve or demo; "
        "several (one per replica) are read as one store",
    )
    parser.add_argument("--step", type=int, help="only this step")
    parser.add_argument("--experiment", help="only this experiment")
    parser.add_argument("--limit", type=int, default=None, help="at most this many trajectories")
    parser.add_argument("--width", type=int, default=100, help="characters of text per call line")


def run_show_command(args: dict[str, Any]) -> int:
    try:
        return show(
            args["directory"],
            step=args["step"],
            experiment=args["experiment"],
            limit=args["limit"],
            width=args["width"],
        )
    except BrokenPipeError:  # `trace-proxy show DIR | head` is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def show(
    directories: str | Path | Sequence[str | Path],
    *,
    step: int | None = None,
    experiment: str | None = None,
    limit: int | None = None,
    width: int = 100,
    out: TextIO | None = None,
) -> int:
    stream = sys.stdout if out is None else out  # the stdout of the moment, not of import
    if isinstance(directories, (str, Path)):
        directories = [directories]
    roots = [Path(directory) for directory in directories]
    for root in roots:
        if not root.is_dir():
            print(f"trace-proxy: error: {printable(str(root))} is not a directory",
                  file=sys.stderr)  # fmt: skip
            return 1
    shown_roots, roots = roots, [store for root in roots for store in store_roots(root)]

    def write(line: str) -> None:
        stream.write(printable(line) + "\n")

    shown = events = 0
    for records, orphans in _by_experiment(roots):
        for line in orphans:
            write(line)
        for record in _ordered(records):
            key = record.get("key") or record
            if experiment is not None and key.get("experiment") != experiment:
                continue
            if record.get("record") == "event":
                if step is None:
                    write(_event_line(record))
                    events += 1
                continue
            if record.get("record") == "step_summary":
                if step is None or record.get("step") == step:
                    write(_summary_line(record))
                continue
            if record.get("record") != "trajectory":
                continue
            if step is not None and key.get("step") != step:
                continue
            if limit is not None and shown >= limit:
                break
            write(_trajectory_header(record))
            calls = record.get("calls") or []
            tools_after: dict[int | None, list[dict[str, Any]]] = {}
            for tool in record.get("tools") or []:
                tools_after.setdefault(tool.get("requested_by"), []).append(tool)
            for tool in tools_after.pop(None, []):
                write(_tool_line(tool, width))
            for call, prompt in zip(calls, expand_prompts(record), strict=True):
                write(_call_line(call, prompt, width))
                for number, segment in enumerate(call.get("segments") or [], 1):
                    write(_segment_line(number, segment))
                for tool in tools_after.get(call.get("index"), []):
                    write(_tool_line(tool, width))
            shown += 1
    write(f"{shown} trajectories, {events} step events under "
          f"{', '.join(map(str, shown_roots))}")  # fmt: skip
    left = leftovers(shown_roots)
    if left:
        print(printable(notice(left)), file=sys.stderr)
    return 0


def _by_experiment(roots: Sequence[Path]) -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
    """Records grouped by the directory (project/experiment) they are stored in, relative to
    their store: the same experiment's directories in several stores make one group. Late
    rewards are merged into each store's record before a trajectory's records from several
    stores are joined, so a reward given to either proxy counts; lines for those naming no
    record stored here."""
    groups = runs(roots, parts=True)
    for name in sorted(groups):
        stored = [(d, record) for d in groups[name] for _, record in run_records(d)]
        if stored:
            orphans = _apply_annotations([record for _, record in stored])
            yield _one_summary_per_step(one_per_trajectory(stored)), orphans


def _one_summary_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's summaries from several stores (replicas) as one, their counts added up."""
    steps: dict[tuple[Any, bool], list[dict[str, Any]]] = {}
    others = []
    for record in records:
        if record.get("record") == "step_summary":
            key = (record.get("step"), bool(record.get("validate")))
            steps.setdefault(key, []).append(record)
        else:
            others.append(record)
    merged = [merged_summary(summaries) for summaries in steps.values()]
    return others + [summary for summary in merged if summary is not None]


def _apply_annotations(records: list[dict[str, Any]]) -> list[str]:
    """Late rewards onto the trajectories they name; lines for those naming none seen here."""
    return [
        f"-- reward for {note.get('target')} (no such trajectory stored here): {_outcome(note)}"
        for note in apply_annotations(records)
    ]


def _outcome(record: dict[str, Any]) -> str:
    parts = [
        f"{name} {record[name]:g}" for name in ("reward", "score") if record.get(name) is not None
    ]
    parts += [f"{k}={v}" for k, v in (record.get("labels") or {}).items()]
    return ", ".join(parts)


def _ordered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trajectories by step, validation, sample and rollout; each step event after the step
    during which it happened (the latest step whose trajectories started before it)."""

    def position(t: dict[str, Any]) -> tuple[Any, ...]:
        k = t.get("key") or {}
        step = -1 if k.get("step") is None else k["step"]
        sample = -1 if k.get("sample_index") is None else k["sample_index"]
        rollout = -1 if k.get("rollout_n") is None else k["rollout_n"]
        return (step, bool(k.get("validate")), sample, rollout, t.get("start") or 0)

    trajectories = sorted((r for r in records if r.get("record") == "trajectory"), key=position)
    placed: list[tuple[tuple[Any, ...], int, dict[str, Any]]] = [
        (position(t), 0, t) for t in trajectories
    ]
    for summary in (r for r in records if r.get("record") == "step_summary"):
        step = -1 if summary.get("step") is None else summary["step"]
        end = (step, bool(summary.get("validate")), float("inf"), float("inf"), float("inf"))
        placed.append((end, 2, summary))
    for event in (r for r in records if r.get("record") == "event"):
        before = [position(t)[0] for t in trajectories if (t.get("start") or 0) <= event["time"]]
        step = max(before, default=-1)
        placed.append(((step, True, float("inf"), float("inf"), event["time"]), 1, event))
    return [record for *_, record in sorted(placed, key=lambda p: (p[0], p[1]))]


def _trajectory_header(t: dict[str, Any]) -> str:
    key = t.get("key") or {}
    parts = [f"{key.get('project')}/{key.get('experiment')}"]
    for name, label in (("step", "step"), ("sample_index", "sample"), ("rollout_n", "rollout")):
        if key.get(name) is not None:
            parts.append(f"{label} {key[name]}")
    if key.get("validate"):
        parts.append("validation")
    if key.get("trajectory_id"):
        parts.append(f"id {key['trajectory_id']}")
    if key.get("sample_id"):
        parts.append(f"sample id {key['sample_id']}")
    summary = t.get("summary") or {}
    duration = (t.get("end") or 0) - (t.get("start") or 0)
    part = f", part {t['part']}" if t.get("part", 1) > 1 else ""
    outcome = _outcome(t)
    if outcome:
        part += f"; {outcome}"
    if summary.get("calls_dropped"):
        part += f"; {summary['calls_dropped']} more calls not recorded (capture fell behind)"
    if summary.get("drift_calls"):
        part += f"; {summary['drift_calls']} calls with retokenization drift"
    low, high = t.get("weight_version_min"), t.get("weight_version_max")
    if low is not None:
        part += f"; version {low}" if low == high else f"; versions {low} to {high}"
        part += ", partial rollout" if t.get("partial_rollout") else ""
    return (
        f"== {' · '.join(parts)}  [{t.get('status')}, closed: {t.get('close_reason')}{part}]  "
        f"{summary.get('calls', 0)} calls, {summary.get('prompt_tokens', 0)}+"
        f"{summary.get('completion_tokens', 0)} tokens, {duration:.2f}s"
    )


def _call_line(call: dict[str, Any], prompt: dict[str, Any], width: int) -> str:
    start, end = call.get("start") or 0, call.get("end") or call.get("start") or 0
    stream = "stream" if call.get("stream") else "      "
    head = (
        f"  #{call.get('index')} {call.get('dialect', '?'):<18} {call.get('http_status') or '---'} "
        f"{stream} {end - start:6.2f}s"
    )
    if call.get("weight_version") is not None:
        head += f" v{call['weight_version']}"
    if call.get("unparsed"):
        return f"{head}  unparsed: {call['unparsed']}"
    asked = _clip(_asked(call, prompt), width // 2)
    answered = _clip(_answered(call), width)
    line = f"{head}  {asked} -> {answered}"
    if call.get("error"):
        line += f"  !! {call['error'].get('type')}: {_clip(call['error'].get('message', ''), 80)}"
    for kind, found in (call.get("drift") or {}).items():
        if isinstance(found, dict):
            line += f"  ~ {kind} drift at {found.get('at')}: {_token(found, 'expected')} -> "
            line += _token(found, "got")
    return line


def _segment_line(number: int, segment: dict[str, Any]) -> str:
    """One attempt of a resumed call: its version, what it carried over, why it stopped."""
    start, end = segment.get("start") or 0, segment.get("end") or segment.get("start") or 0
    version = segment.get("weight_version")
    carried = segment.get("carried_tokens")
    return (
        f"     attempt {number} {end - start:6.2f}s"
        + (f"  version {version}" if version is not None else "")
        + (f"  carried {carried} tokens" if carried else "")
        + f"  generated {segment.get('tokens', '?')} tokens"
        + f"  [{segment.get('finish_reason') or segment.get('http_status') or '?'}]"
    )


def _token(found: dict[str, Any], which: str) -> str:
    """A drift mark's token: its id and its text, quoted (escaped with the line later)."""
    text = found.get(f"{which}_text")
    return f"{found.get(which)} {_clip(json.dumps(text), 40) if text is not None else ''}".strip()


def _tool_line(tool: dict[str, Any], width: int) -> str:
    start, end = tool.get("start") or 0, tool.get("end")
    took = f"{end - start:6.2f}s" if end is not None else "   ?   "
    how = {"chat_tool_calls": "tool", "parsed_from_text": "tool (text)"}.get(
        tool.get("observed", ""), f"tool {tool.get('route') or ''}".strip()
    )
    if tool.get("raw") is not None:
        return f"     {how:<24} {took}  unparsed: {_clip(tool['raw'], width // 2)!r}"
    called = _clip(f"{tool.get('name')}({tool.get('arguments') or ''})", width // 2)
    result = "(no result seen)" if tool.get("result") is None else repr(tool["result"])
    flag = "  !! tool error" if (tool.get("error") or {}).get("type") == "tool_error" else ""
    return f"     {how:<24} {took}  {called} => {_clip(result, width // 2)}{flag}"


def _asked(call: dict[str, Any], prompt: dict[str, Any]) -> str:
    """The newest message (chat), else the end of the decoded prompt, text, or a token count."""
    messages = prompt.get("messages")
    if messages:
        last = messages[-1]
        return f"{last.get('role')}: {_message_text(last)!r}"
    if call.get("prompt_text"):
        return "…" + repr(call["prompt_text"][-200:])
    if prompt.get("text") is not None:
        return repr(prompt["text"])
    ids = prompt.get("token_ids") or []
    return f"{len(ids)} prompt tokens"


def _answered(call: dict[str, Any]) -> str:
    outputs = call.get("outputs") or []
    if not outputs:
        return "(no output)"
    rendered = []
    for output in outputs:
        pieces = []
        text = output.get("text") or (
            None if output.get("tool_calls") else output.get("response_text")
        )
        if text:
            pieces.append(repr(text))
        for tool in output.get("tool_calls") or []:
            fn = tool.get("function") or {}
            pieces.append(f"tool_call {fn.get('name')}({fn.get('arguments')})")
        if not pieces:
            pieces.append(f"{len(output.get('token_ids') or [])} tokens")
        finish = output.get("finish_reason")
        rendered.append(" ".join(pieces) + (f" [{finish}]" if finish else ""))
    return " | ".join(rendered)


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = message.get("tool_calls") or []
    return " ".join(f"{(c.get('function') or {}).get('name')}(...)" for c in calls)


def _summary_line(summary: dict[str, Any]) -> str:
    kind = "validation step" if summary.get("validate") else "step"
    return (
        f"-- {kind} {summary.get('step')}: {summary.get('trajectories_seen')} trajectories "
        f"({summary.get('trajectories_kept')} kept, "
        f"{summary.get('trajectories_dropped_by_sampler')} dropped by the sampler), "
        f"{summary.get('calls_seen')} calls seen, {summary.get('calls_kept')} kept"
    )


def _event_line(event: dict[str, Any]) -> str:
    version = f" version {event['weight_version']}" if event.get("weight_version") else ""
    return (
        f"-- event {event.get('event')}{version} ({event.get('route')} -> "
        f"{event.get('http_status')}) {event.get('project')}/{event.get('experiment')}"
    )


def _clip(text: str, width: int) -> str:
    """At most `width` characters of `text` (escaped later, so no escape is cut in two)."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
