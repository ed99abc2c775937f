"""`trace-proxy show DIR`: the jsonl store, readable in a terminal.

One header line per trajectory (its key, status, size, duration), then one line per call: what
was asked (the newest message, or decoded prompt text) and what came back (text, tool calls).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from trace_proxy.trajectories.prompts import expand_prompts


def iter_records(directory: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every complete record under `directory`, file by file in name order.

    A torn last line (a crash mid-write) is skipped: only newline-terminated lines count.
    """
    for path in sorted(directory.rglob("*.jsonl")):
        data = path.read_bytes()
        for line in data.split(b"\n")[:-1]:
            if line.strip():
                yield path, orjson.loads(line)


def show(
    directory: str | Path,
    *,
    step: int | None = None,
    experiment: str | None = None,
    limit: int | None = None,
    width: int = 100,
    out: TextIO = sys.stdout,
) -> int:
    root = Path(directory)
    if not root.is_dir():
        print(f"trace-proxy: error: {root} is not a directory", file=sys.stderr)
        return 1
    shown = events = 0
    for _, record in iter_records(root):
        key = record.get("key") or {}
        if experiment is not None and (key or record).get("experiment") != experiment:
            continue
        if record.get("record") == "event":
            if step is None:
                out.write(_event_line(record) + "\n")
                events += 1
            continue
        if step is not None and key.get("step") != step:
            continue
        if limit is not None and shown >= limit:
            break
        out.write(_trajectory_header(record) + "\n")
        for call, prompt in zip(record.get("calls") or [], expand_prompts(record), strict=True):
            out.write(_call_line(call, prompt, width) + "\n")
        shown += 1
    out.write(f"{shown} trajectories, {events} step events under {root}\n")
    return 0


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
    summary = t.get("summary") or {}
    duration = (t.get("end") or 0) - (t.get("start") or 0)
    part = f", part {t['part']}" if t.get("part", 1) > 1 else ""
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
    if call.get("unparsed"):
        return f"{head}  unparsed: {call['unparsed']}"
    asked = _clip(_asked(call, prompt), width // 2)
    answered = _clip(_answered(call), width)
    line = f"{head}  {asked} -> {answered}"
    if call.get("error"):
        line += f"  !! {call['error'].get('type')}: {_clip(call['error'].get('message', ''), 80)}"
    return line


def _asked(call: dict[str, Any], prompt: dict[str, Any]) -> str:
    if call.get("prompt_text"):
        return repr(call["prompt_text"][-200:])
    messages = prompt.get("messages")
    if messages:
        last = messages[-1]
        return f"{last.get('role')}: {_message_text(last)!r}"
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
        text = output.get("response_text") or output.get("text")
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


def _event_line(event: dict[str, Any]) -> str:
    version = f" version {event['weight_version']}" if event.get("weight_version") else ""
    return (
        f"-- event {event.get('event')}{version} ({event.get('route')} -> "
        f"{event.get('http_status')}) {event.get('project')}/{event.get('experiment')}"
    )


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
