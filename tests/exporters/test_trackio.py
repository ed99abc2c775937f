"""The trackio backend: real rollouts through a real proxy, read back from trackio's own store.

trackio reads TRACKIO_DIR once, when imported, so the session shares one directory and each
test logs to a project of its own. Stopping the proxy closes the exporter, which finishes the
runs: everything is written when `running` returns, nothing to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from fakes import FakeVLLM
from groundtruth.clients import Sampling, read_vllm_generate, vllm_generate_body
from groundtruth.tooling import (
    TOOLS,
    chat_tool_rollout,
    execute,
    parse_tool_calls,
    tool_results_suffix,
)
from support import version_workload
from support.proxies import trajectories

from trace_proxy.client import post_reward
from trace_proxy.config import Settings
from trace_proxy.dataset.sft import sft_row
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.exporters import BACKENDS
from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.exporters.backends.trackio import (
    ANNOTATION_KEY,
    TRACE_KEY,
    TrackioExporter,
    ensure_visible_first_answer,
)
from trace_proxy.proxy.service import ProxyService
from trace_proxy.store.names import store_name
from trace_proxy.text.toolparsers import get_parser

# Not importorskip: importing trackio here would fix its directory before the fixture sets it.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trackio") is None, reason="the trackio extra is not installed"
)

IM_END_ID = 151645


@pytest.fixture
def project() -> str:
    return f"tp-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def running(
    upstream: str, output: Path, project: str, trackio_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[ProxyService, str]]:
    """A proxy exporting to jsonl (the record, to compare with) and to trackio."""
    settings = dataclasses.replace(
        Settings(), upstream=[upstream], port=0, admin_port=0, output=output, project=project,
        backend=["jsonl", "trackio"], trackio_dir=trackio_dir, **overrides,
    )  # fmt: skip
    service = ProxyService(settings, [JsonlExporter(output), BACKENDS["trackio"](settings)])
    addresses = await service.start()
    try:
        yield service, addresses.proxy
    finally:
        await service.stop()


def traces(project: str, run: str, **query: Any) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    found: list[dict[str, Any]] = SQLiteStorage.get_traces(project, run=run, **query)
    return found


def as_shown(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An SFT row's messages as a trace shows them: empty members left out, and a first answer
    that only calls tools previewed with its calls."""
    shown = [{k: v for k, v in m.items() if v is not None and v is not False} for m in messages]
    ensure_visible_first_answer(shown)
    return shown


def check_times(span: dict[str, Any], start: float, end: float | None) -> None:
    assert datetime.fromisoformat(span["start_time"]).timestamp() == pytest.approx(start, abs=1e-6)
    if end is None:
        assert span["end_time"] is None and span["duration_ms"] is None
        return
    assert datetime.fromisoformat(span["end_time"]).timestamp() == pytest.approx(end, abs=1e-6)
    assert span["duration_ms"] == pytest.approx((end - start) * 1000, abs=1e-3)
    assert span["duration_ms"] >= 0


def check_spans(trace: dict[str, Any], record: dict[str, Any]) -> None:
    """A root for the trajectory; a generation per call and a tool span per tool call under it."""
    spans = trace["spans"]
    calls, tools = record["calls"], record["tools"]
    assert [s["kind"] for s in spans] == ["span"] + ["generation"] * len(calls) + ["tool"] * len(
        tools
    )
    root, generations, tool_spans = spans[0], spans[1 : 1 + len(calls)], spans[1 + len(calls) :]
    assert root["name"] == "agent_loop" and root["parent_id"] is None
    check_times(root, record["start"], record["end"])
    assert len({s["id"] for s in spans}) == len(spans)
    assert all(s["parent_id"] == root["id"] for s in spans[1:])
    for span, call in zip(generations, calls, strict=True):
        check_times(span, call["start"], call["end"])
        assert span["model"] == call["model"] == "tiny-qwen"
        assert span["usage"] == call["usage"] and span["usage"]["completion_tokens"] > 0
        assert span["status"] == "success" and span["error"] is None
        assert span["metadata"]["request_id"] == call["request_id"]
        output = call["outputs"][0]
        assert span["output"]["text"] == (output.get("response_text") or output["text"])
        assert span["output"]["finish_reason"] == output["finish_reason"]
    for span, tool in zip(tool_spans, tools, strict=True):
        check_times(span, tool["start"], tool["end"])
        assert span["name"] == f"execute_tool {tool['name']}"
        assert span["input"] == json.loads(tool["arguments"])
        assert span["output"] == tool["result"]
        assert span["metadata"]["observed"] == tool["observed"]
        failed = tool["error"] is not None
        assert span["status"] == ("error" if failed else "success" if tool["result"] else None)


def check_metadata(trace: dict[str, Any], record: dict[str, Any]) -> None:
    key, summary, meta = record["key"], record["summary"], trace["metadata"]
    for field in ("step", "sample_index", "rollout_n", "validate", "trajectory_id"):
        assert meta[field] == key[field], field
    assert meta["experiment_name"] == key["experiment"]
    for field in ("reward", "score", "labels", "close_reason", "weight_versions"):
        assert meta[field] == record[field], field
    assert meta["prompt_tokens"] == summary["prompt_tokens"] > 0
    assert meta["completion_tokens"] == summary["completion_tokens"] > 0
    assert meta["num_turns"] == len(record["calls"])
    assert meta["num_tool_calls"] == summary["tool_calls"] == len(record["tools"])
    assert meta["record_id"] == record["id"]


async def test_chat_tool_rollout_is_one_trace_with_the_whole_conversation(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, project: str, trackio_dir: Path
) -> None:
    _, upstream = fake_vllm
    headers = {"X-Rollout-Experiment": "exp-chat", "X-Rollout-Step": "3",
               "X-Rollout-Sample-Index": "5", "X-Rollout-N": "1",
               "X-Rollout-Trajectory-Id": "chat-1"}  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is the weather in Paris and in Oslo right now?"},
    ]
    async with running(upstream, tmp_path / "out", project, trackio_dir) as (service, proxy):
        async with aiohttp.ClientSession(headers=headers) as session:
            _, replies = await chat_tool_rollout(session, proxy, messages)
        await service.flush()
        assert service.addresses is not None and service.addresses.admin is not None
        where = await asyncio.to_thread(
            post_reward, service.addresses.admin, reward=1.0, trajectory_id="chat-1",
            labels={"correct": True},
        )  # fmt: skip
        assert where == "open"
    assert len(replies) >= 2 and replies[0]["tool_calls"] and not replies[-1].get("tool_calls")
    [record] = trajectories(tmp_path / "out")
    [trace] = traces(project, "exp-chat")
    assert trace["key"] == TRACE_KEY and trace["step"] == 3

    # The conversation: everything the client sent, then the final answer.
    got = trace["messages"]
    assert [m["role"] for m in got] == [m["role"] for m in messages] + ["assistant"]
    assert got[-1]["content"] == replies[-1]["content"]
    sent_calls = [c for m in messages if m["role"] == "assistant" for c in m["tool_calls"]]
    got_calls = [c for m in got if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert got_calls == sent_calls  # ids, names, arguments exactly as the server wrote them
    assert [m["tool_call_id"] for m in got if m["role"] == "tool"] == [c["id"] for c in sent_calls]
    assert [m["content"] for m in got if m["role"] == "tool"] == [
        m["content"] for m in messages if m["role"] == "tool"
    ]
    # The list previews the first assistant message: a tool-call-only turn shows its calls.
    first = next(m for m in got if m["role"] == "assistant")
    assert replies[0]["content"] in (None, "")
    name, arguments = (replies[0]["tool_calls"][0]["function"][k] for k in ("name", "arguments"))
    assert f"{name}({arguments})" in first["content"]
    assert got[:2] == messages[:2]

    check_spans(trace, record)
    assert {s["observed"] for s in record["tools"]} == {"chat_tool_calls"}
    check_metadata(trace, record)
    assert trace["metadata"]["reward"] == 1.0 and trace["metadata"]["labels"] == {"correct": True}
    assert trace["metadata"]["close_reason"] == "shutdown"
    assert trace["metadata"]["status"] == "success"

    # What `trackio show` reads (its server's functions) and `trackio list traces` prints.
    from trackio import server

    assert server.get_trace_steps(project, "exp-chat") == {
        "total": 1, "steps": [{"step": 3, "count": 1}]
    }  # fmt: skip
    [shown] = server.get_traces(project, run="exp-chat", step=3)
    assert shown["messages"] == got and shown["spans"] == trace["spans"]
    listed = subprocess.run(
        [sys.executable, "-m", "trackio.cli", "list", "traces", "--project", project,
         "--run", "exp-chat", "--json"],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "TRACKIO_DIR": str(trackio_dir)},
    )  # fmt: skip
    [cli_trace] = json.loads(listed.stdout)["traces"]
    assert cli_trace["step"] == 3 and cli_trace["metadata"]["trajectory_id"] == "chat-1"
    assert cli_trace["messages"] == got


async def token_rollout(
    session: aiohttp.ClientSession, proxy: str, tokenizer: Any, question: str, seed: int
) -> list[list[str]]:
    """A verl-style token agent loop over `/inference/v1/generate`; returns the tool results
    it sent back, per turn."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tools=TOOLS, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    sent: list[list[str]] = []
    for _ in range(6):
        body = vllm_generate_body(ids, Sampling(512, 1.0, seed), False, None)
        async with session.post(proxy + "/inference/v1/generate", json=body) as response:
            assert response.status == 200
            reply = read_vllm_generate(await response.read(), False)
        output = reply.token_ids or []
        requests = parse_tool_calls(tokenizer.decode(output, skip_special_tokens=False))
        if not requests or reply.finish_reason != "stop":
            break
        results = [execute(r.name, r.arguments) for r in requests]
        sent.append(results)
        ended = bool(output) and output[-1] == IM_END_ID
        suffix = tool_results_suffix(results, ended)
        ids = [*ids, *output, *tokenizer.encode(suffix, add_special_tokens=False)]
    return sent


async def test_token_rollouts_become_decoded_conversations_at_their_steps(
    qwen_tokenizer: Any,
    fake_vllm: tuple[FakeVLLM, str],
    tmp_path: Path,
    project: str,
    trackio_dir: Path,
) -> None:
    _, upstream = fake_vllm
    settings = {"token2text": True, "tokenizer": [str(ensure_qwen_tokenizer())]}
    keys = [(1, 0, False), (2, 0, False), (2, 1, False), (2, 0, True)]
    sent = {}
    async with running(upstream, tmp_path / "out", project, trackio_dir, **settings) as (_, proxy):
        async with aiohttp.ClientSession() as session:
            for step, sample, validate in keys:
                session.headers.update({
                    "X-Rollout-Experiment": "exp-tokens", "X-Rollout-Step": str(step),
                    "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0",
                    "X-Rollout-Validate": str(validate).lower(),
                })  # fmt: skip
                question = f"Search the docs for topic {sample} and check the weather in Oslo."
                sent[(step, sample, validate)] = await token_rollout(
                    session, proxy, qwen_tokenizer, question, seed=step * 10 + sample
                )
    records = {
        (r["key"]["step"], r["key"]["sample_index"], r["key"]["validate"]): r
        for r in trajectories(tmp_path / "out")
    }
    assert set(records) == set(keys)
    assert [len(traces(project, "exp-tokens", step=s)) for s in (0, 1, 2)] == [0, 1, 3]
    for trace in traces(project, "exp-tokens"):
        meta = trace["metadata"]
        record = records[(meta["step"], meta["sample_index"], meta["validate"])]
        assert trace["step"] == record["key"]["step"] and trace["key"] == TRACE_KEY
        calls, tools = record["calls"], record["tools"]
        assert len(calls) >= 2 and tools and all(s["observed"] == "parsed_from_text" for s in tools)
        results = [
            [s["result"] for s in tools if s["requested_by"] == n] for n in range(len(calls))
        ]
        assert results[:-1] == sent[(meta["step"], meta["sample_index"], meta["validate"])]

        # The SFT export's reading of the record: the first prompt's system and user turns,
        # then per turn the answer (its calls named after the tool spans), its tool results.
        got = trace["messages"]
        assert got == as_shown(sft_row(record, get_parser("hermes"))["messages"])
        assert "<|im_start|>" not in got[0]["content"] and "<tools>" in got[0]["content"]
        answers = [m for m in got if m["role"] == "assistant"]
        expected_roles = ["system", "user"]
        for i in range(len(calls)):
            expected_roles += ["assistant"] + ["tool"] * sum(
                1 for s in tools if s["requested_by"] == i and s["result"] is not None
            )
        assert [m["role"] for m in got] == expected_roles
        position = 1
        for i, answer in enumerate(answers):
            own = [s for s in tools if s["requested_by"] == i]
            asked = answer.get("tool_calls") or []
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in asked] == [
                (s["name"], s["arguments"]) for s in own
            ]
            position = got.index(answer, position) + 1
            answered = [s for s in own if s["result"] is not None]
            results = got[position : position + len(answered)]
            assert [r["content"] for r in results] == [s["result"] for s in answered]
            assert [r["tool_call_id"] for r in results] == [c["id"] for c in asked][: len(results)]

        check_spans(trace, record)
        check_metadata(trace, record)
        generations = [s for s in trace["spans"] if s["kind"] == "generation"]
        # Each generation's input is what its call added: the first prompt, then tool turns.
        assert generations[0]["input"]["text"] == calls[0]["prompt_text"]
        assert generations[1]["input"]["text"] == calls[1]["prompt_text"]
        assert "<tool_response>" in calls[1]["prompt_text"]
        assert generations[1]["input"]["prefix_call"] == 0


async def test_a_trajectory_without_a_step_and_late_rewards(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, project: str, trackio_dir: Path
) -> None:
    _, upstream = fake_vllm

    async def complete(proxy: str, headers: dict[str, str]) -> None:
        body = {"model": "tiny-qwen", "prompt": "Tell me about Oslo.", "max_tokens": 8}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(proxy + "/v1/completions", json=body) as response:
                assert response.status == 200

    def key(step: int) -> dict[str, str]:
        return {"X-Rollout-Experiment": "exp", "X-Rollout-Step": str(step),
                "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0",
                "X-Rollout-Trajectory-Id": f"t-{step}"}  # fmt: skip

    out = tmp_path / "out"
    async with running(upstream, out, project, trackio_dir, step_close_grace=0) as (service, proxy):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        await complete(proxy, {"X-Rollout-Trajectory-Id": "no-step"})  # a trajectory, no step
        await complete(proxy, key(1))
        await complete(proxy, key(2))  # step 2 starts: step 1 is closed and exported
        await service.flush()
        assert await asyncio.to_thread(post_reward, admin, score=0.25, trajectory_id="t-1") == (
            "exported"
        )
        where = await asyncio.to_thread(
            post_reward, admin, reward=-1.0, experiment="exp", step=9, sample_index=4
        )
        assert where == "unknown"

    by_id = {r["key"]["trajectory_id"]: r for r in trajectories(out)}
    [stepless] = traces(project, "default")
    assert by_id["no-step"]["key"]["step"] is None
    assert stepless["step"] == 0 and stepless["metadata"]["step"] is None
    assert stepless["metadata"]["trajectory_id"] == "no-step"
    # A text prompt in no chat template: the prompt as written, marked; the server's text.
    assert stepless["messages"][0] == {
        "role": "user", "content": "Tell me about Oslo.", "unparsed": True
    }  # fmt: skip
    assert stepless["messages"][1]["role"] == "assistant"
    assert stepless["messages"][1]["content"]
    assert stepless["messages"] == as_shown(
        sft_row(by_id["no-step"], get_parser("hermes"))["messages"]
    )
    check_spans(stepless, by_id["no-step"])

    # Logged in one batch, rows share a timestamp: order them here.
    logged = sorted(traces(project, "exp"), key=lambda t: (t["step"], t["key"] != TRACE_KEY))
    assert [(t["key"], t["step"]) for t in logged] == [
        (TRACE_KEY, 1), (ANNOTATION_KEY, 1), (TRACE_KEY, 2), (ANNOTATION_KEY, 9)
    ]  # fmt: skip
    late, never_seen = (t for t in logged if t["key"] == ANNOTATION_KEY)
    assert late["messages"] == [] and late["metadata"]["score"] == 0.25
    assert late["metadata"]["trajectory_id"] == "t-1"
    assert late["metadata"]["applies_to"] == [by_id["t-1"]["id"]]
    assert never_seen["metadata"]["reward"] == -1.0 and never_seen["metadata"]["applies_to"] == []
    assert logged[0]["metadata"]["score"] is None  # exported before the score arrived


async def test_hostile_project_and_experiment_names_stay_in_the_trackio_directory(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, project: str, trackio_dir: Path
) -> None:
    """trackio names its files after the project: it gets the project's store name (bounded,
    ASCII), the metadata keeps the project as sent, and the run keeps the experiment's name."""
    _, upstream = fake_vllm
    outside = tmp_path / "outside"
    outside.mkdir()
    unique = project  # trackio's directory is the session's: names of this test's own
    cases = [  # (project, experiment), the baggage carrying NUL and non-ASCII
        (f"../../{unique}", "../../../run"),
        (str(outside / unique), str(outside / "run")),
        (f"a/b\\{unique}", ".."),
        (f"{unique}\x00", "."),
        ("p" * 240 + unique, "e" * 256),  # too long for a file name, with `.db`
        (unique + "\u00e9" * 120, "\u00e9" * 256),
    ]
    watched = trackio_dir.parent
    before = {p for p in watched.rglob("*") if not p.is_relative_to(tmp_path)}
    body = {"model": "tiny-qwen", "prompt": "Hi", "max_tokens": 2}
    async with running(upstream, tmp_path / "out", project, trackio_dir) as (_, proxy):
        async with aiohttp.ClientSession() as session:
            for number, (name, experiment) in enumerate(cases):
                baggage = ",".join(f"rollout.{k}={quote(v, safe='')}" for k, v in
                                   (("project", name), ("experiment", experiment)))  # fmt: skip
                headers = {"baggage": baggage, "X-Rollout-Step": "1", "X-Rollout-Done": "true",
                           "X-Rollout-Trajectory-Id": f"t{number}"}  # fmt: skip
                async with session.post(proxy + "/v1/completions", json=body,
                                        headers=headers) as response:  # fmt: skip
                    assert response.status == 200
    after = {p for p in watched.rglob("*") if not p.is_relative_to(tmp_path)}
    assert all(p.is_relative_to(trackio_dir) for p in after - before)
    assert not list(outside.iterdir())
    assert all(len(p.name.encode()) < 200 for p in after - before)
    for number, (name, experiment) in enumerate(cases):
        [trace] = traces(store_name(name), experiment)
        assert trace["metadata"]["trajectory_id"] == f"t{number}"
        assert trace["metadata"]["project"] == name
        assert trace["metadata"]["experiment_name"] == experiment


async def test_a_project_name_trackio_refuses_is_counted_as_rejected_not_exported(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, project: str, trackio_dir: Path
) -> None:
    """trackio reserves some project names (`registry-*`, a suffix of its own tables): those
    records are dropped and counted as rejected, the others of the same batch still go out."""
    _, upstream = fake_vllm
    body = {"model": "tiny-qwen", "prompt": "Hi", "max_tokens": 2}
    names = [project, f"registry-{project}", f"{project}_traces", project]
    async with running(upstream, tmp_path / "out", project, trackio_dir) as (service, proxy):
        async with aiohttp.ClientSession() as session:
            for number, name in enumerate(names):
                headers = {
                    "X-Rollout-Project": name,
                    "X-Rollout-Step": "1",
                    "X-Rollout-Done": "true",
                    "X-Rollout-Trajectory-Id": f"t{number}",
                }
                async with session.post(proxy + "/v1/completions", json=body,
                                        headers=headers) as response:  # fmt: skip
                    assert response.status == 200
        await service.flush()
        sample = service.metrics.registry.get_sample_value
        rejected = sample("trace_proxy_export_dropped_total",
                          {"backend": "trackio", "reason": "rejected"})  # fmt: skip
        exported = sample("trace_proxy_exported_records_total", {"backend": "trackio"})
    assert rejected == 2
    assert exported == 2  # the two of the project trackio takes, and nothing else
    ids = {t["metadata"]["trajectory_id"] for t in traces(store_name(project), "default")}
    assert ids == {"t0", "t3"}


def test_one_trackio_directory_per_process(trackio_dir: Path, tmp_path: Path) -> None:
    TrackioExporter("p", trackio_dir).close()
    with pytest.raises(RuntimeError, match="reads TRACKIO_DIR"):
        TrackioExporter("p", tmp_path / "elsewhere")


def test_a_re_rendered_token_conversation_and_a_failed_call(
    qwen_tokenizer: Any, trackio_dir: Path, project: str
) -> None:
    """When the client re-renders earlier turns, the pieces do not line up: the conversation is
    the turns of the last call's whole decoded prompt and its answer; the spans still show
    every call."""
    from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
    from trace_proxy.text.toolparsers import get_parser
    from trace_proxy.trajectories.record import (
        CallError,
        GenerateCall,
        Output,
        Prompt,
        RolloutKey,
        Trajectory,
    )

    encode = qwen_tokenizer.encode
    prompt = encode("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    rerendered = said.replace('{"city": "Oslo"}', '{"city":"Oslo"}') + "<|im_end|>"
    results = (
        "\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    calls = [
        GenerateCall(
            index=0, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
            start=10.0, end=11.0, model="tiny-qwen", prompt=Prompt(token_ids=prompt),
            outputs=[Output(index=0, token_ids=encode(said + "<|im_end|>"))],
        ),
        GenerateCall(
            index=1, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
            start=12.0, end=12.5, model="tiny-qwen",
            prompt=Prompt(token_ids=prompt + encode(rerendered + results)),
            outputs=[Output(index=0, token_ids=encode("Oslo: 18C.<|im_end|>"))],
        ),
        GenerateCall(
            index=2, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
            start=13.0, end=13.25, http_status=502, prompt=Prompt(token_ids=prompt),
            error=CallError("transport", "upstream unreachable"),
        ),
    ]  # fmt: skip
    trajectory = Trajectory(
        id="rerendered", key=RolloutKey(project=project, experiment="e", step=4), start=10.0,
        end=12.5, status="ok", close_reason="done", calls=calls[:2],
    )  # fmt: skip
    tokenizers = Tokenizers()
    tokenizers.add(None, decoder_for(qwen_tokenizer, skip_special_tokens=False))
    Token2Text(tokenizers, get_parser("hermes")).process([trajectory])
    assert trajectory.transcript is not None  # stored whole: the pieces do not spell it out
    failed = Trajectory(
        id="failed", key=RolloutKey(project=project, experiment="e", step=4), start=13.0,
        end=13.25, status="error", close_reason="done", calls=[calls[2]],
    )  # fmt: skip

    exporter = TrackioExporter(project, trackio_dir)
    exporter.export([trajectory, failed])
    # In the database when export() returns: the spool's cursor moves past them right after.
    by_id = {t["metadata"]["record_id"]: t for t in traces(project, "e", step=4)}
    assert set(by_id) == {"rerendered", "failed"}
    exporter.close()

    # The last prompt read whole: its turns (the answer as re-rendered, its call named as the
    # prompt writes it), then its answer.
    messages = by_id["rerendered"]["messages"]
    asked = {"id": "prompt_1_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    assert messages == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": 'get_weather({"city": "Oslo"})', "tool_calls": [asked]},
        {"role": "tool", "content": "18C", "tool_call_id": "prompt_1_0", "name": "get_weather"},
        {"role": "assistant", "content": "Oslo: 18C."},
    ]
    spans = by_id["rerendered"]["spans"]
    assert [s["kind"] for s in spans] == ["span", "generation", "generation", "tool"]
    assert spans[3]["input"] == {"city": "Oslo"} and spans[3]["output"] == "18C"

    broken = by_id["failed"]
    assert broken["metadata"]["status"] == "error"
    root, call = broken["spans"]
    assert root["status"] == call["status"] == "error"
    assert call["error"] == "transport: upstream unreachable"
    assert call["metadata"]["http_status"] == 502 and call["output"] is None
    assert broken["messages"][0]["role"] == "user"  # the prompt, not decoded: said so
    assert "--token2text" in broken["messages"][0]["content"]


def writer_threads() -> int:
    """trackio's writer threads: one per open run."""
    return sum("_local_batch_sender" in t.name for t in threading.enumerate())


def test_open_runs_are_bounded_and_a_reopened_run_continues(
    trackio_dir: Path, project: str
) -> None:
    """Requests can name any number of experiments, and each open trackio run holds a writer
    thread: at most `max_open_runs` stay open, the least recently used one is finished, and one
    needed again is reopened, so its traces continue in the same run, not a new one of the
    same name."""
    from trace_proxy.trajectories.record import RolloutKey, Trajectory

    def record(number: int, experiment: str, step: int) -> Trajectory:
        key = RolloutKey(project=project, experiment=experiment, step=step,
                         trajectory_id=f"{experiment}/{step}/{number}")  # fmt: skip
        return Trajectory(id=f"{experiment}-{step}-{number}", key=key, start=1.0, end=2.0,
                          status="ok", close_reason="done", calls=[])  # fmt: skip

    exporter = TrackioExporter(project, trackio_dir, max_open_runs=4)
    from trackio.sqlite_storage import SQLiteStorage  # after the exporter set its directory

    before = writer_threads()
    experiments = [f"e{n}" for n in range(10)]
    for step in range(2):  # the same experiments again: each run reopened once
        for experiment in experiments:
            exporter.export([record(0, experiment, step)])
            assert writer_threads() - before <= 4
    # One batch naming more runs than may be open: opened and written a few at a time.
    exporter.export([record(n, e, 2) for n in range(2) for e in experiments])
    assert writer_threads() - before <= 4
    exporter.close()
    assert writer_threads() == before

    runs = [r for r in SQLiteStorage.get_run_records(project)]
    assert sorted(r["name"] for r in runs) == experiments  # one run each: none duplicated
    for run in runs:
        found = SQLiteStorage.get_traces(project, run_id=run["id"])
        assert sorted(t["metadata"]["trajectory_id"] for t in found) == sorted(
            f"{run['name']}/{step}/{n}" for step, n in ((0, 0), (1, 0), (2, 0), (2, 1))
        )
        assert sorted(t["step"] for t in found) == [0, 1, 2, 2]


def test_a_user_turn_a_later_prompt_adds_after_tool_results_is_a_message(
    qwen_tokenizer: Any, trackio_dir: Path, project: str
) -> None:
    """Three generate calls whose prompts are ChatML ids, as a token agent sends them: P1 =
    system + user + tools; P2 = P1 + R1 + the tool's response; P3 = P2 + R2 + the user's next
    question. The trace's conversation holds every turn, the question included, and is the
    SFT export's row for the same record (one reading of decoded text for both)."""
    from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
    from trace_proxy.trajectories.prompts import share_prefixes
    from trace_proxy.trajectories.record import (
        GenerateCall,
        Output,
        Prompt,
        RolloutKey,
        Trajectory,
        dumps,
    )

    french = "Thanks! Now say it once more in French…"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    first = qwen_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful agent."},
         {"role": "user", "content": "Is it raining in Oslo?"}],
        tools=tools, tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    answers = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>",
        "Yes, it is raining in Oslo.<|im_end|>",
        "Oui, il pleut à Oslo.<|im_end|>",
    ]
    added = [
        "\n<|im_start|>user\n<tool_response>\n"
        '{"city": "Oslo", "sky": "rain"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n',
        f"\n<|im_start|>user\n{french}<|im_end|>\n<|im_start|>assistant\n",
    ]
    encode = qwen_tokenizer.encode
    prompts = [encode(first)]
    for position, more in enumerate(added):
        prompts.append([*prompts[-1], *encode(answers[position]), *encode(more)])
    calls = [
        GenerateCall(
            index=n, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
            start=10.0 + n, end=10.5 + n, model="tiny-qwen", prompt=Prompt(token_ids=prompt),
            outputs=[Output(index=0, token_ids=encode(answer), finish_reason="stop")],
        )
        for n, (prompt, answer) in enumerate(zip(prompts, answers, strict=True))
    ]  # fmt: skip
    share_prefixes(calls)
    trajectory = Trajectory(
        id="three-calls", key=RolloutKey(project=project, experiment="e", step=3), start=10.0,
        end=13.0, status="ok", close_reason="done", calls=calls,
    )  # fmt: skip
    tokenizers = Tokenizers()
    tokenizers.add(None, decoder_for(qwen_tokenizer, skip_special_tokens=False))
    Token2Text(tokenizers, get_parser("hermes")).process([trajectory])
    assert [s.name for s in trajectory.tools] == ["get_weather"]

    exporter = TrackioExporter(project, trackio_dir)  # hermes, as `--tool-parser` defaults
    exporter.export([trajectory])
    [trace] = traces(project, "e", step=3)
    exporter.close()

    got = trace["messages"]
    assert [m["role"] for m in got] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant"
    ]  # fmt: skip
    assert [m.get("content") for m in got[1:]] == [
        "Is it raining in Oslo?",
        'get_weather({"city": "Oslo"})',  # the dashboard's preview of a tool-only answer
        '{"city": "Oslo", "sky": "rain"}',
        "Yes, it is raining in Oslo.",
        french,
        "Oui, il pleut à Oslo.",
    ]
    assert "<tools>" in got[0]["content"] and "<|im_start|>" not in got[0]["content"]
    assert got[3]["tool_call_id"] == got[2]["tool_calls"][0]["id"]
    assert not any(m.get("unparsed") for m in got)

    row = sft_row(orjson.loads(dumps(trajectory)), get_parser("hermes"))
    assert row["messages"][2]["content"] is None  # the row keeps a tool-only answer's null
    assert got == as_shown(row["messages"])


def test_decoded_text_is_read_with_the_proxys_tool_parser(trackio_dir: Path, project: str) -> None:
    """`--tool-parser gpt_oss` reaches the backend: a harmony prompt is read as its turns, not
    as ChatML (which would leave it one unparsed user message)."""
    from trace_proxy.trajectories.record import GenerateCall, Output, Prompt, RolloutKey, Trajectory

    prompt = (
        "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>Weather in "
        "Oslo?<|end|><|start|>assistant"
    )
    call = GenerateCall(
        index=0, dialect="openai.completions", route="/v1/completions", upstream="u",
        start=1.0, end=1.5, prompt=Prompt(text=prompt),
        outputs=[Output(index=0, text="<|channel|>final<|message|>Rain.<|return|>")],
    )  # fmt: skip
    trajectory = Trajectory(
        id="harmony", key=RolloutKey(project=project, experiment="e", step=1), start=1.0,
        end=1.5, status="ok", close_reason="done", calls=[call],
    )  # fmt: skip
    settings = dataclasses.replace(
        Settings(), project=project, trackio_dir=trackio_dir, tool_parser="gpt_oss"
    )
    exporter = BACKENDS["trackio"](settings)
    exporter.export([trajectory])
    [trace] = traces(project, "e", step=1)
    exporter.close()
    assert trace["messages"] == [
        {"role": "system", "content": "You are ChatGPT."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Rain."},
    ]


async def test_traces_carry_policy_versions_and_lag(
    qwen_tokenizer: Any, tmp_path: Path, project: str, trackio_dir: Path
) -> None:
    """A partial rollout resumed across a weight sync and a rollout on one version, closed one
    sync later (tests/support/version_workload.py): each trace's metadata says the sample id, the
    oldest, newest and newest-seen versions, their spread, the lag and the partial flag, and
    each generation span its version and lag, as the other backends say them."""
    async with version_workload.upstream(qwen_tokenizer) as upstream:
        async with running(upstream, tmp_path / "out", project, trackio_dir) as (_, proxy):
            async with aiohttp.ClientSession() as session:
                await version_workload.partial_rollouts(session, proxy, qwen_tokenizer)
    records = version_workload.by_sample(trajectories(tmp_path / "out"))
    found = {t["metadata"]["sample_index"]: t for t in traces(project, version_workload.EXPERIMENT)}
    assert sorted(found) == sorted(records) == [0, 1]
    for sample, trace in found.items():
        low, high, latest, partial, sample_id = version_workload.EXPECTED[sample]
        meta = trace["metadata"]
        assert {name: meta[name] for name in (
            "sample_id", "weight_version_min", "weight_version_max", "weight_version_latest",
            "partial_rollout", "version_spread", "version_lag")} == {
            "sample_id": sample_id, "weight_version_min": low, "weight_version_max": high,
            "weight_version_latest": latest, "partial_rollout": partial,
            "version_spread": int(high) - int(low), "version_lag": 1,
        }  # fmt: skip
        [generation] = [s for s in trace["spans"] if s["kind"] == "generation"]
        meta = generation["metadata"]
        assert (meta["weight_version"], meta["version_lag"]) == ("4", 1)
    [resumed] = [s for s in found[0]["spans"] if s["kind"] == "generation"]
    assert [s["weight_version"] for s in resumed["metadata"]["segments"]] == ["3", "4"]
