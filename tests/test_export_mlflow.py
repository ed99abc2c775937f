"""The MLflow backend, round-tripped through a real in-process MLflow store (sqlite).

Trajectories go through a real proxy to `MlflowExporter` and are read back with MLflow's own
search and get APIs: span names, types and parents, exact times, inputs and outputs with the
decoded text, verl's tags, the run link, and a late reward set as a tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeVLLM
from proxy_helpers import trajectories

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
mlflow = pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from trace_proxy.client import post_reward  # noqa: E402
from trace_proxy.config import Settings  # noqa: E402
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer  # noqa: E402
from trace_proxy.exporters.jsonl import JsonlExporter  # noqa: E402
from trace_proxy.exporters.mlflow import MlflowExporter, create, trace_id_of  # noqa: E402
from trace_proxy.proxy.service import ProxyService  # noqa: E402
from trace_proxy.trajectories.prompts import transcript_of  # noqa: E402
from trace_proxy.trajectories.record import (  # noqa: E402
    Annotation,
    CallError,
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    StepSummary,
    ToolCall,
    Trajectory,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATML = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
MORE = "<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"


def ns(seconds: float) -> int:
    """The record's time (epoch seconds, microsecond resolution) in nanoseconds."""
    return round(seconds * 1_000_000) * 1_000


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sqlite store for the module (creating MLflow's tables takes seconds); the tests
    use experiments of their own. MLflow's fluent readers find it through the environment."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


@contextlib.asynccontextmanager
async def proxy_with(
    upstream: str, output: Path, exporter: MlflowExporter, **overrides: Any
) -> AsyncIterator[tuple[ProxyService, str]]:
    settings = dataclasses.replace(
        Settings(), upstream=[upstream], port=0, admin_port=0, output=output, **overrides
    )
    service = ProxyService(settings, exporters=[JsonlExporter(output), exporter])
    addresses = await service.start()
    try:
        yield service, addresses.proxy
    finally:
        await service.stop()


def key(step: int, sample: int, trajectory: str) -> dict[str, str]:
    return {"X-Rollout-Experiment": "grpo-7b", "X-Rollout-Step": str(step),
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0",
            "X-Rollout-Trajectory-Id": trajectory}  # fmt: skip


async def test_trajectories_round_trip_through_mlflow(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any, tmp_path: Path, tracking_uri: str
) -> None:
    _, upstream = fake_vllm
    exporter = MlflowExporter(tracking_uri, "rl-project", None)
    settings = {"project": "rl-project", "token2text": True,
                "tokenizer": [str(ensure_qwen_tokenizer())]}  # fmt: skip
    done = {"X-Rollout-Done": "true"}
    async with (
        proxy_with(upstream, tmp_path, exporter, **settings) as (service, proxy),
        aiohttp.ClientSession() as http,
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        # A: chat with a tool call, and a reward while it is open.
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS, "max_tokens": 40}
        async with http.post(proxy + "/v1/chat/completions", json=body,
                             headers=key(1, 0, "a")) as response:  # fmt: skip
            message = (await response.json())["choices"][0]["message"]
        await service.capture.drain()
        await asyncio.to_thread(post_reward, admin, reward=1.0, labels={"correct": True},
                                trajectory_id="a")  # fmt: skip
        [tool_call] = message["tool_calls"]
        messages += [message, {"role": "tool", "tool_call_id": tool_call["id"], "content": "18C"}]
        body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS, "max_tokens": 6}
        async with http.post(proxy + "/v1/chat/completions", json=body,
                             headers={**key(1, 0, "a"), **done}) as response:  # fmt: skip
            assert response.status == 200
        # B: token ids, two turns (the second extends the first), and a late score.
        ids = qwen_tokenizer.encode(CHATML)
        body = {"model": "tiny-qwen", "prompt": ids, "max_tokens": 4, "return_token_ids": True}
        async with http.post(proxy + "/v1/completions", json=body,
                             headers=key(1, 1, "b")) as response:  # fmt: skip
            first = (await response.json())["choices"][0]["token_ids"]
        ids = ids + first + qwen_tokenizer.encode(MORE)
        body = {"model": "tiny-qwen", "prompt": ids, "max_tokens": 4, "return_token_ids": True}
        async with http.post(proxy + "/v1/completions", json=body,
                             headers={**key(1, 1, "b"), **done}) as response:  # fmt: skip
            second = (await response.json())["choices"][0]["token_ids"]
        # C: another step.
        body = {"model": "tiny-qwen", "prompt": "Hello", "max_tokens": 3}
        async with http.post(proxy + "/v1/completions", json=body,
                             headers={**key(2, 0, "c"), **done}) as response:  # fmt: skip
            assert response.status == 200
        await service.capture.drain()
        await service.pipeline.flush()
        assert await asyncio.to_thread(post_reward, admin, score=0.5, trajectory_id="b") == (
            "exported"
        )
    records = {t["key"]["trajectory_id"]: t for t in trajectories(tmp_path)}
    a, b, c = records["a"], records["b"], records["c"]

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("rl-project")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "grpo-7b"  # the default run: the trajectories' experiment
    assert run.info.status == "FINISHED"  # created by the exporter, ended when it closed

    found = mlflow.search_traces(
        locations=[experiment.experiment_id], filter_string="tags.step = '1'", return_type="list"
    )
    assert {t.info.trace_id for t in found} == {trace_id_of(a["id"]), trace_id_of(b["id"])}
    linked = mlflow.search_traces(
        locations=[experiment.experiment_id], run_id=run.info.run_id, return_type="list"
    )
    assert len(linked) == 3

    trace = mlflow.get_trace(trace_id_of(a["id"]))
    info = trace.info
    assert {k: v for k, v in info.tags.items() if not k.startswith("mlflow.")} == {
        "step": "1", "sample_index": "0", "rollout_n": "0", "validate": "False",
        "experiment_name": "grpo-7b", "trajectory_id": "a", "reward": "1.0",
        "label.correct": "true",
    }  # fmt: skip
    assert info.trace_metadata["mlflow.sourceRun"] == run.info.run_id
    assert info.state.value == "OK"
    assert info.request_preview == "Weather in Paris?"
    assert info.token_usage == {
        "input_tokens": sum(call["usage"]["prompt_tokens"] for call in a["calls"]),
        "output_tokens": sum(call["usage"]["completion_tokens"] for call in a["calls"]),
        "total_tokens": sum(call["usage"]["total_tokens"] for call in a["calls"]),
    }
    root, llm1, tool, llm2 = trace.data.spans  # in start order
    assert [(s.name, s.span_type) for s in trace.data.spans] == [
        ("agent_loop", "AGENT"), ("generate", "LLM"), ("get_weather", "TOOL"),
        ("generate", "LLM"),
    ]  # fmt: skip
    assert root.parent_id is None
    assert {s.parent_id for s in (llm1, llm2, tool)} == {root.span_id}
    assert (root.start_time_ns, root.end_time_ns) == (ns(a["start"]), ns(a["end"]))
    for span, call in zip((llm1, llm2), a["calls"], strict=True):
        assert (span.start_time_ns, span.end_time_ns) == (ns(call["start"]), ns(call["end"]))
        assert span.get_attribute("mlflow.llm.model") == "tiny-qwen"
    [tool_record] = a["tools"]
    assert (tool.start_time_ns, tool.end_time_ns) == (
        ns(tool_record["start"]), ns(tool_record["end"])
    )  # fmt: skip
    assert llm1.inputs == {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "sampling_params": {"max_tokens": 40},
    }
    assert llm2.inputs["messages"][:2] == a["calls"][0]["prompt"]["messages"] + [
        a["calls"][1]["prompt"]["messages"][0]
    ]  # the whole conversation, not the stored suffix
    assert llm2.inputs["messages"][-1] == messages[-1]
    assert llm1.outputs["choices"][0]["message"]["tool_calls"] == message["tool_calls"]
    assert llm1.outputs["choices"][0]["finish_reason"] == "tool_calls"
    assert llm1.outputs["usage"] == a["calls"][0]["usage"]
    assert tool.inputs == {"city": "Paris"}
    assert tool.outputs == "18C"
    assert tool.get_attribute("call_id") == tool_call["id"]
    assert root.inputs == {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    assert root.outputs["reward"] == 1.0 and root.outputs["num_turns"] == 2

    trace = mlflow.get_trace(trace_id_of(b["id"]))
    assert trace.info.tags["score"] == "0.5"  # the late score, from its annotation
    assert "reward" not in trace.info.tags
    root, turn1, turn2 = trace.data.spans
    text1 = qwen_tokenizer.decode(first)
    assert turn1.inputs["prompt_text"] == CHATML
    assert turn1.outputs["choices"][0]["response_text"] == text1
    assert turn1.outputs["choices"][0]["token_ids"] == first
    assert turn2.inputs["prompt_ids"] == ids  # the whole prompt, not the shared suffix
    assert turn2.inputs["prompt_text"] == CHATML + text1 + MORE
    assert turn2.outputs["choices"][0]["response_text"] == qwen_tokenizer.decode(second)
    assert root.outputs["transcript"] == transcript_of(b)
    assert root.outputs["transcript"] == CHATML + text1 + MORE + qwen_tokenizer.decode(second)

    [step2] = mlflow.search_traces(
        locations=[experiment.experiment_id], filter_string="tags.step = '2'", return_type="list"
    )
    assert step2.info.trace_id == trace_id_of(c["id"])


def trajectory(record_id: str, step: int, project: str = "runs") -> Trajectory:
    call = GenerateCall(
        index=0, dialect="openai.completions", route="/v1/completions", upstream="u",
        start=1_700_000_000.000001, end=1_700_000_000.5, prompt=Prompt(text="2+2="),
        outputs=[Output(index=0, text="4", finish_reason="stop")],
    )  # fmt: skip
    tool = ToolCall(index=0, observed="http_tool_server", start=1_700_000_000.5, end=None,
                    name="calc", arguments="[1, 2]", result=None)  # fmt: skip
    return Trajectory(
        id=record_id, key=RolloutKey(project=project, experiment="exp", step=step, validate=True),
        start=call.start, end=1_700_000_000.75, status="ok", close_reason="done", calls=[call],
        tools=[tool],
    )  # fmt: skip


def test_run_by_id_or_name_retries_and_step_summaries(tracking_uri: str) -> None:
    client = MlflowClient(tracking_uri)
    experiment_id = client.create_experiment("runs")
    trainer = client.create_run(experiment_id, run_name="trainer").info.run_id

    by_id = MlflowExporter(tracking_uri, "runs", trainer)
    batch: list[Any] = [trajectory("11" * 16, 3)]
    by_id.export(batch)
    by_id.export(batch)  # a retried batch rewrites the same trace
    by_id.close()
    [trace] = mlflow.search_traces(locations=[experiment_id], run_id=trainer, return_type="list")
    assert trace.info.trace_id == "tr-" + "11" * 16
    assert trace.info.tags["validate"] == "True"
    _, generate, tool = trace.data.spans
    assert [s.span_type for s in trace.data.spans] == ["AGENT", "LLM", "TOOL"]
    assert generate.start_time_ns == 1_700_000_000_000_001_000
    assert (tool.start_time_ns, tool.end_time_ns) == (
        1_700_000_000_500_000_000, 1_700_000_000_750_000_000  # never answered: ends with it
    )  # fmt: skip
    assert tool.inputs == {"arguments": "[1, 2]"} and tool.outputs is None
    assert generate.inputs == {"prompt": "2+2=", "sampling_params": {}}
    assert generate.outputs["choices"] == [{"index": 0, "text": "4", "finish_reason": "stop"}]
    assert client.get_run(trainer).info.status == "RUNNING"  # not ours to end

    # A run name: created once, found again after a restart.
    for attempt in range(2):
        by_name = MlflowExporter(tracking_uri, "runs", "proxy-run")
        summary = StepSummary(project="runs", experiment="exp", step=3, validate=False,
                              trajectories_seen=8, trajectories_kept=2)  # fmt: skip
        by_name.export([trajectory(f"{attempt + 2}" * 32, 4), summary])
        by_name.close()
    [run] = client.search_runs([experiment_id], filter_string="attributes.run_name = 'proxy-run'")
    linked = mlflow.search_traces(
        locations=[experiment_id], run_id=run.info.run_id, return_type="list"
    )
    assert {t.info.trace_id for t in linked} == {"tr-" + "2" * 32, "tr-" + "3" * 32}
    history = client.get_metric_history(run.info.run_id, "trace_proxy/trajectories_kept")
    assert [(m.step, m.value) for m in history] == [(3, 2.0), (3, 2.0)]

    # A late reward for a trajectory exported here, and one for a trajectory never seen.
    note = Annotation(project="runs", experiment="exp", step=4, validate=True,
                      target={"trajectory_id": "t"}, trajectories=["2" * 32, "9" * 32],
                      time=0.0, reward=-1.0)  # fmt: skip
    by_name.export([note])
    assert mlflow.get_trace("tr-" + "2" * 32).info.tags["reward"] == "-1.0"


def failed(record_id: str, project: str) -> Trajectory:
    t = trajectory(record_id, 7, project)
    t.status = "error"
    t.calls[0].error = CallError(type="http_503", message="overloaded")
    return t


def test_errors_and_a_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file store keeps spans as trace artifacts and cannot link runs (sourceRun does)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17 refuses it otherwise
    uri = (tmp_path / "mlruns").as_uri()
    exporter = MlflowExporter(uri, "runs", None)
    exporter.export([failed("44" * 16, "runs")])
    exporter.close()
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("runs").experiment_id])
    trace = client.get_trace("tr-" + "44" * 16)
    assert trace.info.state.value == "ERROR"
    assert trace.info.trace_metadata["mlflow.sourceRun"] == run.info.run_id
    assert trace.info.tags["step"] == "7"
    root, generate, _ = trace.data.spans
    assert generate.status.status_code.value == "ERROR"
    assert generate.status.description == "http_503: overloaded"
    assert root.status.description == "1 of 1 calls failed; call 0: http_503: overloaded"


def test_server_path_puts_the_tags_on_the_root_span(tracking_uri: str) -> None:
    """To an http(s) server only the spans go (OTLP) and the server makes the trace from them,
    reading tags from `mlflow.traceTag.<k>` root attributes: here the same store call, in
    process, stands in for the server's OTLP handler."""
    exporter = MlflowExporter(tracking_uri, "server", None)
    exporter._remote = True  # what an http(s) URI sets
    exporter.export([failed("55" * 16, "server")])
    trace = mlflow.get_trace("tr-" + "55" * 16)
    assert {"step": "7", "validate": "True", "experiment_name": "exp"}.items() <= (
        trace.info.tags.items()
    )
    assert trace.info.state.value == "ERROR"
    assert "mlflow.sourceRun" not in trace.info.trace_metadata  # linked, not stamped
    [run] = MlflowClient(tracking_uri).search_runs([trace.info.experiment_id])
    linked = mlflow.search_traces(
        locations=[trace.info.experiment_id], run_id=run.info.run_id, return_type="list"
    )
    assert [t.info.trace_id for t in linked] == ["tr-" + "55" * 16]


def test_create_defaults_to_sqlite_under_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    settings = dataclasses.replace(Settings(), output=tmp_path, project="p", mlflow_run="r")
    exporter = create(settings)
    assert exporter.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (exporter.project, exporter.run) == ("p", "r")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert create(settings).tracking_uri == "http://mlflow:5000"
    settings.mlflow_tracking_uri = "sqlite:////data/m.db"
    assert create(settings).tracking_uri == "sqlite:////data/m.db"
