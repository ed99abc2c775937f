"""Stores for the viewer's tests, written the way the jsonl store writes them
(docs/record-schema.md): directories named by `store_name` with their name files, one record
per line."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import orjson

from trace_proxy.store.layout import NAME_FILE
from trace_proxy.store.names import store_name

SCHEMA = "trace-proxy.trajectory/3"


def run_dir(root: Path, project: str = "proj", experiment: str = "exp") -> Path:
    path = root / store_name(project) / store_name(experiment)
    path.mkdir(parents=True, exist_ok=True)
    (path.parent / NAME_FILE).write_text(json.dumps(project))
    (path / NAME_FILE).write_text(json.dumps(experiment))
    return path


def call(
    index: int,
    response: str,
    *,
    prompt_ids: list[int] | None = None,
    output_ids: list[int] | None = None,
    prompt_text: str | None = None,
    prefix_call: int | None = None,
    prefix_len: int | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: list[float] | None = None,
    start: float = 100.0,
) -> dict[str, Any]:
    prompt_ids = [1, 2, 3, 4, 5] if prompt_ids is None else prompt_ids
    output_ids = [7, 8, 9] if output_ids is None else output_ids
    return {
        "index": index, "kind": "generate", "dialect": "openai.completions",
        "route": "/v1/completions", "upstream": "http://127.0.0.1:1", "start": start + index,
        "first_byte": start + index + 0.1, "end": start + index + 0.5, "http_status": 200,
        "stream": False, "request_id": f"cmpl-{index}", "model": "m", "sampling": {},
        "prompt": {
            "token_ids": prompt_ids, "text": None, "messages": None, "tools": None,
            "prefix_call": prefix_call,
            "prefix_len": None if prefix_len is None else {"token_ids": prefix_len},
        },
        "outputs": [{
            "index": 0, "text": response, "token_ids": output_ids, "logprobs": logprobs,
            "finish_reason": "stop", "stop_reason": None, "tool_calls": tool_calls,
            "reasoning": None, "response_text": response,
        }],
        "usage": None, "weight_version": None, "error": None, "unparsed": None,
        "request_headers": None, "prompt_text": prompt_text, "segments": None,
    }  # fmt: skip


def trajectory(
    *,
    step: int | None = 1,
    sample: int | None = 0,
    rollout: int | None = 0,
    reward: float | None = None,
    project: str = "proj",
    experiment: str = "exp",
    validate: bool = False,
    calls: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    labels: dict[str, Any] | None = None,
    status: str = "ok",
    ident: str | None = None,
) -> dict[str, Any]:
    calls = [call(0, "hello")] if calls is None else calls
    return {
        "schema": SCHEMA, "record": "trajectory", "id": ident or uuid.uuid4().hex,
        "key": {
            "project": project, "experiment": experiment, "step": step, "sample_index": sample,
            "rollout_n": rollout, "validate": validate, "trajectory_id": None,
            "sample_hash": None, "sources": {},
        },
        "start": 100.0, "end": 100.0 + len(calls), "status": status, "close_reason": "done",
        "part": 1, "calls": calls, "tools": tools or [], "transcript": None, "reward": reward,
        "score": None, "labels": labels, "upstreams": [], "weight_versions": [],
        "annotations": [],
        "summary": {
            "calls": len(calls), "errors": int(status != "ok"), "unparsed": 0,
            "tool_calls": len(tools or []), "prompt_tokens": 5 * len(calls),
            "completion_tokens": sum(len(c["outputs"][0]["token_ids"]) for c in calls),
            "calls_dropped": 0,
        },
    }  # fmt: skip


def annotation(
    targets: list[str], reward: float, step: int = 1, labels: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "schema": SCHEMA, "record": "annotation", "target": {"step": step},
        "trajectories": targets, "reward": reward, "score": None, "labels": labels,
        "time": 200.0, "project": "proj", "experiment": "exp", "step": step, "validate": False,
    }  # fmt: skip


def line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record) + b"\n"


def append(path: Path, *records: dict[str, Any], raw: bytes = b"") -> None:
    with open(path, "ab") as handle:
        handle.write(b"".join(line(r) for r in records) + raw)


def step_file(directory: Path, step: int | None, validate: bool = False) -> Path:
    name = "none" if step is None else f"{step:06d}"
    return directory / f"{'validate-step-' if validate else 'step-'}{name}.jsonl"
