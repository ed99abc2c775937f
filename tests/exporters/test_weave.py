"""The Weave backend: Weave's real client (`WeaveClient` + `RemoteHTTPTraceServer`) against a
fake trace server (tests/fakes/weave_server.py): weave ships no local server to test against.
The contract asserted is what reaches `POST /v2/{entity}/{project}/calls/complete`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeVLLM
from groundtruth.tooling import TOOLS, chat_tool_rollout
from support import version_workload
from support.proxies import running_proxy, trajectories

from trace_proxy.client import post_reward
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.exporters.base import ExportRejected
from trace_proxy.proxy.service import ProxyService
from trace_proxy.trajectories.record import (
    CallError,
    GenerateCall,
    Output,
    Record,
    RolloutKey,
    Trajectory,
)

# Weave decides when first imported whether it reports errors to Sentry (which hangs offline);
# importorskip imports it before the exporter module could say no, so say it here.
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
pytest.importorskip("weave")
from fakes.weave_server import FakeWeaveServer

from trace_proxy.exporters.backends.weave import WeaveExporter, WeaveExportError, call_id

KEY = "k" * 40
AUTHORIZATION = "Basic " + base64.b64encode(f"api:{KEY}".encode()).decode()
COMPLETE = "POST /v2/ent/proj/calls/complete"


@contextlib.asynccontextmanager
async def running(
    upstream: str, output: Path, weave_url: str
) -> AsyncIterator[tuple[ProxyService, str]]:
    settings = dataclasses.replace(
        Settings(), upstream=[upstream], port=0, admin_port=0, output=output, project="tp"
    )
    exporter = WeaveExporter("ent", "proj", server_url=weave_url, api_key=KEY)
    service = ProxyService(settings, [JsonlExporter(output), exporter])
    addresses = await service.start()
    try:
        yield service, addresses.proxy
    finally:
        await service.stop()


async def export(exporter: WeaveExporter, records: list[Record]) -> None:
    """As the pipeline calls it: in a worker thread. Bounded, so a hang fails the test."""
    await asyncio.wait_for(asyncio.to_thread(exporter.export, records), 30)


def at(value: str) -> datetime:
    assert value.endswith("Z"), value
    return datetime.fromisoformat(value[:-1] + "+00:00")


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


async def test_chat_tool_rollout_is_one_call_tree(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    headers = {"X-Rollout-Experiment": "exp-w", "X-Rollout-Step": "3",
               "X-Rollout-Sample-Index": "17", "X-Rollout-N": "2",
               "X-Rollout-Trajectory-Id": "w-1"}  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris and in Oslo right now?"}
    ]
    fake = FakeWeaveServer()
    async with fake.serve() as weave_url:
        async with running(upstream, tmp_path / "out", weave_url) as (service, proxy):
            async with aiohttp.ClientSession(headers=headers) as session:
                asked, _ = await chat_tool_rollout(session, proxy, messages)
            await service.flush()
            assert service.addresses is not None and service.addresses.admin is not None
            await asyncio.to_thread(
                post_reward, service.addresses.admin, reward=1.0, trajectory_id="w-1",
                labels={"correct": True},
            )  # fmt: skip
    [record] = trajectories(tmp_path / "out")
    calls, tools = record["calls"], record["tools"]
    assert len(calls) == len(asked) >= 2 and tools
    expected = {call_id(record["id"], "root")}
    expected |= {call_id(record["id"], f"call/{c['index']}") for c in calls}
    expected |= {call_id(record["id"], f"tool/{t['index']}") for t in tools}
    assert Counter(c["id"] for c in fake.calls) == dict.fromkeys(expected, 1)
    assert set(fake.paths()) == {"POST /obj/create", "POST /file/create", COMPLETE}
    assert {r.headers["Authorization"] for r in fake.requests} == {AUTHORIZATION}
    assert {c["project_id"] for c in fake.calls} == {"ent/proj"}
    by_id = fake.stored
    root = by_id[call_id(record["id"], "root")]

    # The root: the trajectory.
    assert root["parent_id"] is None and root["trace_id"] == root["id"]
    assert root["op_name"] == f"weave:///ent/proj/op/agent_loop:{fake.objects['agent_loop']}"
    assert root["display_name"] == "step 3 · sample 17 · rollout 2"
    attributes = {k: v for k, v in root["attributes"].items() if k != "weave"}
    assert attributes == {
        "step": 3, "sample_index": 17, "rollout_n": 2, "validate": record["key"]["validate"],
        "experiment_name": "exp-w", "trajectory_id": "w-1", "project": "tp",
        "record_id": record["id"], "reward": 1.0, "labels": {"correct": True},
        "partial_rollout": False,
    }  # fmt: skip
    assert root["attributes"]["weave"]["client_version"] == "0.54.0"
    assert at(root["started_at"]) == utc(record["start"])
    assert at(root["ended_at"]) == utc(record["end"])
    assert root["inputs"] == {k: record["key"][k] for k in
                              ("experiment", "step", "sample_index", "rollout_n", "validate",
                               "trajectory_id")}  # fmt: skip
    assert root["output"]["reward"] == 1.0 and root["output"]["labels"] == {"correct": True}
    assert root["output"]["summary"] == record["summary"]
    assert root["exception"] is None
    # Weave rolls the children's usage up into the root's summary.
    usage = root["summary"]["usage"]["tiny-qwen"]
    assert usage["requests"] == len(calls)
    assert usage["completion_tokens"] == sum(c["usage"]["completion_tokens"] for c in calls)

    # A child per generate call: the full messages in (prefix sharing undone), the answer out.
    for call, sent in zip(calls, asked, strict=True):
        child = by_id[call_id(record["id"], f"call/{call['index']}")]
        assert child["parent_id"] == root["id"] and child["trace_id"] == root["id"]
        assert child["op_name"] == f"weave:///ent/proj/op/chat:{fake.objects['chat']}"
        assert child["display_name"] == "chat tiny-qwen"
        assert at(child["started_at"]) == utc(call["start"])
        assert at(child["ended_at"]) == utc(call["end"])
        assert child["inputs"]["messages"] == sent
        assert child["inputs"]["tools"] == TOOLS and child["inputs"]["model"] == "tiny-qwen"
        [choice] = child["output"]["choices"]
        output = call["outputs"][0]
        assert choice["message"]["content"] == output["text"]
        assert choice["message"].get("tool_calls") == output["tool_calls"]
        assert choice["finish_reason"] == output["finish_reason"]
        assert child["output"]["usage"] == call["usage"]
        assert child["output"]["id"] == call["request_id"]
        assert child["attributes"]["request_id"] == call["request_id"]
        assert child["attributes"]["dialect"] == "openai.chat"
        assert child["summary"]["usage"]["tiny-qwen"] == {"requests": 1, **call["usage"]}
        assert child["exception"] is None

    # A child per tool call.
    for tool in tools:
        child = by_id[call_id(record["id"], f"tool/{tool['index']}")]
        assert child["parent_id"] == root["id"] and child["trace_id"] == root["id"]
        assert child["op_name"] == (
            f"weave:///ent/proj/op/execute_tool:{fake.objects['execute_tool']}"
        )
        assert child["display_name"] == tool["name"]
        assert child["inputs"] == {"name": tool["name"], "call_id": tool["call_id"],
                                   "arguments": json.loads(tool["arguments"])}  # fmt: skip
        assert child["output"] == tool["result"]
        assert child["attributes"]["observed"] == "chat_tool_calls"
        assert at(child["started_at"]) == utc(tool["start"])
        assert at(child["ended_at"]) == utc(tool["end"])


T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def trajectory(record_id: str) -> Trajectory:
    """A validation rollout of two token calls, the second failed."""
    answered = GenerateCall(
        index=0, dialect="vllm.generate", route="/inference/v1/generate", upstream="http://u",
        start=T0 + 0.25, end=T0 + 1.5, model="tiny-qwen", http_status=200,
        outputs=[Output(index=0, token_ids=[1, 2], finish_reason="stop", response_text="hi")],
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    )  # fmt: skip
    answered.prompt.token_ids = [7, 8, 9]
    answered.prompt_text = "question"
    failed = GenerateCall(
        index=1, dialect="vllm.generate", route="/inference/v1/generate", upstream="http://u",
        start=T0 + 2.125, end=T0 + 2.5, model="tiny-qwen", http_status=500,
        error=CallError(type="http_500", message="engine overloaded"),
    )  # fmt: skip
    failed.prompt.token_ids = [7, 8, 9, 1, 2, 4]
    key = RolloutKey(project="tp", experiment="e", step=1, sample_index=0, rollout_n=0,
                     validate=True)  # fmt: skip
    return Trajectory(id=record_id, key=key, start=T0 + 0.25, end=T0 + 2.5, status="error",
                      close_reason="done", calls=[answered, failed])  # fmt: skip


def ids(record_id: str) -> list[str]:
    """The trajectory's call ids, in the order they are sent (its root last)."""
    return [call_id(record_id, what) for what in ("call/0", "call/1", "root")]


async def test_token_calls_and_failed_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Weave's own retries down to the HTTP client's (3 tries, 0.5 s and 1 s apart).
    monkeypatch.setenv("WEAVE_RETRY_MAX_ATTEMPTS", "1")
    a, b, c = (trajectory(letter * 32) for letter in "abc")
    fake = FakeWeaveServer(fail_with=500)
    async with fake.serve() as url:
        exporter = WeaveExporter("ent", "proj", server_url=url, api_key=KEY)

        # Down from the start: the ops cannot be saved, so no call can be sent.
        with pytest.raises(WeaveExportError, match="1 of 1 trajectories could not be prepared"):
            await export(exporter, [a])
        assert fake.calls == [] and "POST /obj/create" in fake.paths()
        fake.fail_with = None
        await export(exporter, [a])  # the pipeline's retry
        assert [call["id"] for call in fake.calls] == ids(a.id)
        answered, failed, root = (fake.stored[id_] for id_ in ids(a.id))
        assert root["display_name"] == "step 1 · sample 0 · rollout 0 · validate"
        assert root["op_name"] == f"weave:///ent/proj/op/agent_loop:{fake.objects['agent_loop']}"
        assert (root["started_at"], root["ended_at"]) == (
            "2023-11-14T22:13:20.250000Z", "2023-11-14T22:13:22.500000Z")  # fmt: skip
        assert {k: root["attributes"][k] for k in ("step", "sample_index", "rollout_n",
                "validate", "experiment_name")} == {"step": 1, "sample_index": 0,
                "rollout_n": 0, "validate": True, "experiment_name": "e"}  # fmt: skip
        assert root["output"]["status"] == "error" and root["exception"] is None
        assert root["summary"] == {
            "usage": {"tiny-qwen": {"requests": 1, "prompt_tokens": 3, "completion_tokens": 2,
                                    "total_tokens": 5}},
            "status_counts": {"success": 2, "error": 1},
        }  # fmt: skip
        for child in (answered, failed):
            assert (child["trace_id"], child["parent_id"]) == (root["id"], root["id"])
            assert child["op_name"] == f"weave:///ent/proj/op/generate:{fake.objects['generate']}"
            assert child["display_name"] == "generate tiny-qwen"
        assert answered["inputs"] == {"model": "tiny-qwen", "prompt_token_ids": [7, 8, 9],
                                      "prompt_text": "question"}  # fmt: skip
        assert answered["output"] == {"id": None, "model": "tiny-qwen", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None},
             "token_ids": [1, 2], "response_text": "hi"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip
        assert (answered["started_at"], answered["ended_at"]) == (
            "2023-11-14T22:13:20.250000Z", "2023-11-14T22:13:21.500000Z")  # fmt: skip
        assert answered["exception"] is None
        assert failed["inputs"] == {"model": "tiny-qwen", "prompt_token_ids": [7, 8, 9, 1, 2, 4]}
        assert failed["output"] == {"id": None, "model": "tiny-qwen", "choices": []}
        assert json.loads(failed["exception"]) == {
            "type": "CallFailed", "message": "http_500: engine overloaded"}  # fmt: skip
        assert failed["attributes"]["http_status"] == 500
        assert (failed["started_at"], failed["ended_at"]) == (
            "2023-11-14T22:13:22.125000Z", "2023-11-14T22:13:22.500000Z")  # fmt: skip

        # The server fails after accepting the first of b's calls (one call per request here).
        exporter.request_budget = 1
        fake.fail_with, fake.fail_after = 500, 1
        sent = len(fake.requests)
        with pytest.raises(WeaveExportError, match="did not accept 1 calls"):
            await export(exporter, [b])
        assert set(fake.paths()[sent:]) == {COMPLETE}  # the ops are saved: calls only
        assert [call["id"] for call in fake.calls] == ids(a.id) + ids(b.id)[:1]
        fake.fail_with = None
        await export(exporter, [b])  # the retry sends what the server does not have yet
        assert [call["id"] for call in fake.calls] == ids(a.id) + ids(b.id)
        assert Counter(call["id"] for call in fake.calls) == dict.fromkeys(ids(a.id) + ids(b.id), 1)

        # Refused as invalid (or too large): retrying would not help, the pipeline drops it.
        fake.fail_with = 422
        with pytest.raises(ExportRejected, match="HTTP 422"):
            await export(exporter, [c])
        fake.fail_with = None

        # Nothing waits in weave's client between exports: close() sends nothing.
        sent = len(fake.requests)
        await asyncio.wait_for(asyncio.to_thread(exporter.close), 30)
        assert len(fake.requests) == sent


async def test_backend_weave_from_the_command_line_goes_through_the_export_process(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, upstream = fake_vllm
    fake = FakeWeaveServer()
    async with fake.serve() as weave_url:
        monkeypatch.setenv("WF_TRACE_SERVER_URL", weave_url)  # the export process inherits these
        monkeypatch.setenv("WANDB_API_KEY", KEY)
        monkeypatch.delenv("WANDB_ENTITY", raising=False)
        async with (
            running_proxy([upstream], tmp_path, backend=["jsonl", "weave"], weave_entity="ent",
                          project="proj") as (service, proxy),
            aiohttp.ClientSession() as session,
        ):  # fmt: skip
            assert service.recorder.backends == ["jsonl", "weave"]
            for sample in range(3):
                body = {
                    "model": "tiny-qwen",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"question {sample}"}],
                }
                headers = {"X-Rollout-Step": "5", "X-Rollout-Sample-Index": str(sample),
                           "X-Rollout-Done": "1"}  # fmt: skip
                async with session.post(
                    proxy + "/v1/chat/completions", json=body, headers=headers
                ) as response:
                    assert response.status == 200
    records = trajectories(tmp_path)
    roots = {r["id"]: fake.stored[call_id(r["id"], "root")] for r in records}
    assert sorted(root["display_name"] for root in roots.values()) == [
        f"step 5 · sample {i}" for i in range(3)
    ]
    assert len(fake.stored) == 2 * len(records)  # a root and its one chat call each
    assert Counter(c["id"] for c in fake.calls) == dict.fromkeys(fake.stored, 1)


async def test_backend_weave_needs_an_entity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    with pytest.raises(ConfigError, match=r"weave cannot start: .*--weave-entity or WANDB_ENTITY"):
        async with running_proxy(["http://127.0.0.1:9"], tmp_path, backend=["weave"]):
            raise AssertionError("the proxy started without a weave entity")


IMPORTS_FROM_WORKER_THREADS = """
import asyncio, builtins, sys, threading
from fakes.weave_server import FakeWeaveServer
from trace_proxy.exporters.backends.weave import WeaveExporter
from exporters.test_dropped_calls import all_dropped

imported_by_workers = []
real_import = builtins.__import__

def watched_import(name, *args, **kwargs):
    before = set(sys.modules)
    module = real_import(name, *args, **kwargs)
    if threading.current_thread() is not threading.main_thread():
        imported_by_workers.extend(sorted(set(sys.modules) - before))
    return module

async def main():
    fake = FakeWeaveServer()
    async with fake.serve() as url:
        exporter = WeaveExporter("ent", "proj", server_url=url, api_key="k" * 40)
        builtins.__import__ = watched_import
        await asyncio.to_thread(exporter.export, [all_dropped()])
        builtins.__import__ = real_import
    assert fake.calls, "nothing was exported"

asyncio.run(main())
print(imported_by_workers)
"""


def test_an_export_imports_no_module_from_a_worker_thread() -> None:
    """Weave's client imports its resource modules lazily, from its worker threads, where two
    imports at once can fail with `_DeadlockError` and lose an op save: in a fresh interpreter,
    a first export must find every module it needs already imported."""
    import subprocess
    import sys

    tests = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_FROM_WORKER_THREADS],
        capture_output=True,
        text=True,
        cwd=tests,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


async def test_calls_carry_policy_versions_and_lag(qwen_tokenizer: Any, tmp_path: Path) -> None:
    """A partial rollout resumed across a weight sync and a rollout on one version, closed one
    sync later (tests/support/version_workload.py): each root call's attributes say the sample
    id, the oldest, newest and newest-seen versions, their spread, the lag and the partial flag,
    and each generate call its version and lag, as the other backends say them."""
    fake = FakeWeaveServer()
    async with version_workload.upstream(qwen_tokenizer) as upstream, fake.serve() as weave_url:
        async with running(upstream, tmp_path / "out", weave_url) as (_, proxy):
            async with aiohttp.ClientSession() as session:
                await version_workload.partial_rollouts(session, proxy, qwen_tokenizer)
    records = version_workload.by_sample(trajectories(tmp_path / "out"))
    for sample, record in records.items():
        low, high, latest, partial, sample_id = version_workload.EXPECTED[sample]
        root = fake.stored[call_id(record["id"], "root")]["attributes"]
        assert {name: root[name] for name in (
            "sample_id", "weight_version_min", "weight_version_max", "weight_version_latest",
            "partial_rollout", "version_spread", "version_lag")} == {
            "sample_id": sample_id, "weight_version_min": low, "weight_version_max": high,
            "weight_version_latest": latest, "partial_rollout": partial,
            "version_spread": int(high) - int(low), "version_lag": 1,
        }  # fmt: skip
        generate = fake.stored[call_id(record["id"], "call/0")]["attributes"]
        assert (generate["weight_version"], generate["version_lag"]) == ("4", 1)
