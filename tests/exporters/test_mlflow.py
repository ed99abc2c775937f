"""The MLflow backend, round-tripped through a real in-process MLflow store (sqlite).

Trajectories go through a real proxy to `MlflowExporter` and are read back with MLflow's own
search and get APIs: span names, types and parents, exact times, inputs and outputs with the
decoded text, verl's tags, the run link, and a late reward set as a tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest
from fakes import FakeVLLM
from fakes.mlflow_server import EXPERIMENT_HEADER, FakeMlflowServer, OtlpExport, ReceivedSpan
from support import version_workload
from support.proxies import inline_pipeline, metric, trajectories

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
mlflow = pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.store.tracking.rest_store import RestStore  # noqa: E402

from trace_proxy.client import post_reward  # noqa: E402
from trace_proxy.config import Settings  # noqa: E402
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer  # noqa: E402
from trace_proxy.exporters import BACKENDS  # noqa: E402
from trace_proxy.exporters.backends import mlflow as mlflow_exporter  # noqa: E402
from trace_proxy.exporters.backends.jsonl import JsonlExporter  # noqa: E402
from trace_proxy.exporters.backends.mlflow import MlflowExporter, trace_id_of  # noqa: E402
from trace_proxy.exporters.backends.mlflow_names import label_tag, literal, substitute  # noqa: E402
from trace_proxy.exporters.base import ExportRejected  # noqa: E402
from trace_proxy.proxy.service import ProxyService  # noqa: E402
from trace_proxy.store.names import digest  # noqa: E402
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
QUESTION = "Weather in Paris and Berlin?"  # two cities: a tool call in each of two turns
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


class Sent(NamedTuple):
    """What rollouts_a_and_b sent and got back."""

    messages: list[dict[str, Any]]  # A's conversation, up to its tool result
    message: dict[str, Any]  # A's first answer, with its tool call
    tool_call: dict[str, Any]
    ids: list[int]  # B's second prompt
    first: list[int]  # B's outputs
    second: list[int]


async def rollouts_a_and_b(
    http: aiohttp.ClientSession, proxy: str, service: ProxyService, qwen_tokenizer: Any
) -> Sent:
    """A: a chat rollout with a tool call, and a reward while it is open; B: two turns of
    token ids, the second extending the first."""
    assert service.addresses is not None and service.addresses.admin is not None
    admin = service.addresses.admin
    done = {"X-Rollout-Done": "true"}
    # A: chat with a tool call, and a reward while it is open.
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS, "max_tokens": 40}
    async with http.post(proxy + "/v1/chat/completions", json=body,
                         headers=key(1, 0, "a")) as response:  # fmt: skip
        message = (await response.json())["choices"][0]["message"]
    await service.flush()
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
    return Sent(messages, message, tool_call, ids, first, second)


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
        sent = await rollouts_a_and_b(http, proxy, service, qwen_tokenizer)
        messages, message, tool_call, ids, first, second = sent
        # C: another step.
        body = {"model": "tiny-qwen", "prompt": "Hello", "max_tokens": 3}
        async with http.post(proxy + "/v1/completions", json=body,
                             headers={**key(2, 0, "c"), **done}) as response:  # fmt: skip
            assert response.status == 200
        await service.flush()
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
    assert info.request_preview == QUESTION
    assert info.token_usage == {
        "input_tokens": sum(call["usage"]["prompt_tokens"] for call in a["calls"]),
        "output_tokens": sum(call["usage"]["completion_tokens"] for call in a["calls"]),
        "total_tokens": sum(call["usage"]["total_tokens"] for call in a["calls"]),
    }
    # The second turn's reply, cut by max_tokens inside a tool call written as text, is a tool
    # span of its own that says so.
    root, llm1, tool, llm2, cut = trace.data.spans  # in start order
    assert [(s.name, s.span_type) for s in trace.data.spans] == [
        ("agent_loop", "AGENT"), ("generate", "LLM"), ("get_weather", "TOOL"),
        ("generate", "LLM"), ("tool", "TOOL"),
    ]  # fmt: skip
    assert cut.status.status_code.value == "ERROR"
    assert root.parent_id is None
    assert {s.parent_id for s in (llm1, llm2, tool)} == {root.span_id}
    assert (root.start_time_ns, root.end_time_ns) == (ns(a["start"]), ns(a["end"]))
    for span, call in zip((llm1, llm2), a["calls"], strict=True):
        assert (span.start_time_ns, span.end_time_ns) == (ns(call["start"]), ns(call["end"]))
        assert span.get_attribute("mlflow.llm.model") == "tiny-qwen"
    tool_record, cut_record = a["tools"]
    assert cut_record["error"]["type"] == "unparsed_tool_call"
    assert (tool.start_time_ns, tool.end_time_ns) == (
        ns(tool_record["start"]), ns(tool_record["end"])
    )  # fmt: skip
    assert llm1.inputs == {
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": TOOLS,
        "sampling_params": {"max_tokens": 40},
    }
    assert a["calls"][1]["prompt"]["messages"] == messages[-1:]  # the reply is not stored twice
    assert llm2.inputs["messages"] == messages  # the whole conversation, not the stored suffix
    assert llm1.outputs["choices"][0]["message"]["tool_calls"] == message["tool_calls"]
    assert llm1.outputs["choices"][0]["finish_reason"] == "tool_calls"
    assert llm1.outputs["usage"] == a["calls"][0]["usage"]
    assert tool.inputs == {"city": "Paris"}
    assert tool.outputs == "18C"
    assert tool.get_attribute("call_id") == tool_call["id"]
    assert root.inputs == {"messages": [{"role": "user", "content": QUESTION}]}
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


def run_name(name: str) -> str:
    """The name of the run for a record's experiment: longer names do not fit MLflow's column."""
    return name if len(name) <= 250 else substitute(name, 250)


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_names_from_requests_are_data_not_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """MLflow 3.17 keeps experiment and run names in its database (sqlite) or in meta.yaml
    files (file store), and names directories by ids: a hostile project (the MLflow
    experiment) or experiment (the run) is data, never a path, so they are given as sent."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    where = tmp_path / "a" / "b" / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    uri = f"sqlite:///{where / 'mlflow.db'}" if store == "sqlite" else (where / "mlruns").as_uri()
    names = ["../../x", str(outside / "abs"), "a/b\\c", "nul\x00", ".", "..", "n" * 256,
             "\u00e9" * 256]  # fmt: skip
    exporter = MlflowExporter(uri, "default", None)
    for number, name in enumerate(names):
        record = trajectory(f"{number:032x}", 1, project=name)
        record.key.experiment = name
        exporter.export([record, StepSummary(project=name, experiment=name, step=1,
                                             validate=False)])  # fmt: skip
    exporter.close()
    elsewhere = [p for p in tmp_path.rglob("*") if not p.is_relative_to(where)]
    assert sorted(elsewhere) == [tmp_path / "a", tmp_path / "a" / "b", outside]
    assert not list(outside.iterdir())
    client = MlflowClient(uri)
    for number, name in enumerate(names):
        experiment = client.get_experiment_by_name(name)
        assert experiment is not None
        [run] = client.search_runs([experiment.experiment_id])
        assert run.info.run_name == run_name(name)
        trace = client.get_trace(trace_id_of(f"{number:032x}"))
        assert trace.info.experiment_id == experiment.experiment_id


# Names MLflow's search filters cannot quote as they are: its parser (sqlparse) has no escapes,
# so a value is whatever lies between two `'` or two `"`; and its file store looks an experiment
# up with `name = '<name>'`, unquoted, so there a `'` breaks the lookup or changes the filter.
QUOTED = ["it's", 'say "hi"', "it's \"both\"", "'", '"', "'\"", "a\\", "\\'\"",
          "x' AND name LIKE '%", ("q'\"" * 86)[:256]]  # fmt: skip


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_names_with_quotes_find_their_experiment_and_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """Each such name gets one experiment and one run, found again by a restarted exporter;
    on the file store a name with `'` gets an experiment of another name that keeps the name
    as a tag, since MLflow itself cannot look it up there."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else (tmp_path / "m").as_uri()
    for restart in range(2):
        exporter = MlflowExporter(uri, "default", None)
        for number, name in enumerate(QUOTED):
            record = trajectory(f"{restart}{number:031x}", 1, project=name)
            record.key.experiment = name
            summary = StepSummary(project=name, experiment=name, step=1, validate=False,
                                  trajectories_kept=1)  # fmt: skip
            exporter.export([record, summary])
        exporter.close()
    client = MlflowClient(uri)
    experiments = set()
    for number, name in enumerate(QUOTED):
        first, second = (client.get_trace(trace_id_of(f"{r}{number:031x}")) for r in range(2))
        experiment = client.get_experiment(first.info.experiment_id)
        assert second.info.experiment_id == experiment.experiment_id
        experiments.add(experiment.experiment_id)
        if store == "sqlite" or "'" not in name:
            assert experiment.name == name
        else:
            assert "'" not in experiment.name
            assert experiment.tags["trace_proxy.project"] == name
        [run] = client.search_runs([experiment.experiment_id])
        assert run.info.run_name == run_name(name)
        for trace in (first, second):
            assert trace.info.trace_metadata["mlflow.sourceRun"] == run.info.run_id
            assert trace.info.tags["experiment_name"] == name
        history = client.get_metric_history(run.info.run_id, "trace_proxy/trajectories_kept")
        assert len(history) == 2
    assert len(experiments) == len(QUOTED)


def test_filter_literals_substitutes_and_label_tags() -> None:
    assert literal("it's") == '"it\'s"' and literal('say "hi"') == "'say \"hi\"'"
    assert literal("a\\") == "'a\\'" and literal("x' AND name LIKE '%") is not None
    assert [name for name in QUOTED if literal(name) is None] == [
        name for name in QUOTED if "'" in name and '"' in name
    ]
    names = [*QUOTED, "n" * 600, "n" * 601]
    for limit in (250, 500):
        stored = {substitute(name, limit) for name in names}
        assert len(stored) == len(names)
        assert all(len(s) <= limit and "'" not in s for s in stored)
    assert label_tag("correct") == "label.correct" and label_tag("a/b c:d") == "label.a/b c:d"
    assert label_tag("pass@1") != label_tag("pass#1")
    assert all(len(label_tag(n)) <= 250 for n in ("l" * 300, "a/../b", "x//y", "\x00"))


def test_an_experiment_name_over_mlflows_limit_gets_a_substitute(tracking_uri: str) -> None:
    """Requests name projects of at most 256 characters; a longer default project (possible
    through the Python API only) gets an experiment named by its substitute."""
    project = "p" * 600
    for restart in range(2):
        exporter = MlflowExporter(tracking_uri, project)
        exporter.export([trajectory(f"{restart + 6}" * 32, 1, project="")])
        exporter.close()
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(substitute(project, 500))
    assert experiment.tags["trace_proxy.project"] == project
    found = mlflow.search_traces(locations=[experiment.experiment_id], return_type="list")
    assert sorted(t.info.trace_id for t in found) == ["tr-" + "6" * 32, "tr-" + "7" * 32]


async def test_a_record_mlflow_refuses_for_good_is_dropped_and_the_others_go_out(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record MLflow refuses as invalid (here a run name, refused by injection) would fail
    every retry: it is dropped and counted, and the records after it still go out. Labels that
    are no valid MLflow tag names (`pass@1`) become tags of valid names instead of refusals."""
    create_run = MlflowClient.create_run

    def refusing(self: MlflowClient, experiment_id: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("run_name") == "refused":
            raise MlflowException.invalid_parameter_value("this run name is refused")
        return create_run(self, experiment_id, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", refusing)
    records = [trajectory(f"{number:032x}", 1, "refusals") for number in range(1, 5)]
    records[1].key.experiment = "refused"
    labels = {"pass@1": True, "a/../b": 1, "l" * 300: "long", "ok": "yes"}
    records[2].labels = dict(labels)
    late = Annotation(project="refusals", experiment="exp", step=1, validate=True,
                      target={"trajectory_id": "t"}, trajectories=[records[3].id], time=0.0,
                      labels={"pass@1": False})  # fmt: skip
    pipeline, metrics = inline_pipeline(tmp_path / "spool", [MlflowExporter(tracking_uri, "x")])
    await pipeline.start()
    try:
        for record in [*records, late]:
            pipeline.submit(record)
        await asyncio.wait_for(pipeline.flush(), 60)  # a record retried forever never flushes
    finally:
        await pipeline.close(timeout=1.0)
    assert metric(metrics, "trace_proxy_export_dropped_total", backend="mlflow",
                  reason="rejected") == 1  # fmt: skip
    assert metric(metrics, "trace_proxy_exported_records_total", backend="mlflow") == 4
    experiment_id = MlflowClient(tracking_uri).get_experiment_by_name("refusals").experiment_id
    found = mlflow.search_traces(locations=[experiment_id], return_type="list")
    assert sorted(t.info.trace_id for t in found) == [
        trace_id_of(records[number].id) for number in (0, 2, 3)
    ]
    tags = mlflow.get_trace(trace_id_of(records[2].id)).info.tags
    labelled = {k: v for k, v in tags.items() if k.startswith("label.")}
    assert labelled["label.ok"] == "yes"
    assert sorted(labelled.values()) == ["1", "long", "true", "yes"]
    assert all(len(k) <= 250 and re.fullmatch(r"[\w.\- :/]+", k) for k in labelled)
    assert any(k.startswith("label.pass_1") for k in labelled)
    late_tags = mlflow.get_trace(trace_id_of(records[3].id)).info.tags
    assert [v for k, v in late_tags.items() if k.startswith("label.pass_1")] == ["false"]


def test_experiments_and_runs_remembered_are_bounded(
    tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests can name any number of experiments: the exporter remembers the latest
    REMEMBERED experiments and runs, ends a run it created when it forgets it, and finds the
    same run again by name when a record names it once more."""
    monkeypatch.setattr(mlflow_exporter, "REMEMBERED", 3)
    exporter = MlflowExporter(tracking_uri, "bounded")
    names = [f"run-{n}" for n in range(8)]
    for again in range(2):
        for number, name in enumerate(names):
            record = trajectory(f"{again + 1}{number:031x}", 1, project=f"bounded-{number % 4}")
            record.key.experiment = name
            exporter.export([record])
            assert len(exporter._experiments) <= 3 and len(exporter._runs) <= 3
            assert len(exporter._created_runs) <= 3
    exporter.close()
    client = MlflowClient(tracking_uri)
    for number, name in enumerate(names):
        experiment = client.get_experiment_by_name(f"bounded-{number % 4}")
        [run] = client.search_runs([experiment.experiment_id],
                                   filter_string=f"attributes.run_name = '{name}'")  # fmt: skip
        assert run.info.status == "FINISHED"
        linked = mlflow.search_traces(
            locations=[experiment.experiment_id], run_id=run.info.run_id, return_type="list"
        )
        assert sorted(t.info.trace_id for t in linked) == [
            trace_id_of(f"{again}{number:031x}") for again in (1, 2)
        ]


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
    exporter = BACKENDS["mlflow"](settings)
    assert exporter.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (exporter.project, exporter.run) == ("p", "r")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert BACKENDS["mlflow"](settings).tracking_uri == "http://mlflow:5000"
    settings.mlflow_tracking_uri = "sqlite:////data/m.db"
    assert BACKENDS["mlflow"](settings).tracking_uri == "sqlite:////data/m.db"


# --- the http(s) path: MLflow's REST client and OTLP, against a tracking server ----------------
#
# A fake server (tests/fakes/mlflow_server.py) that records what MLflow's own client sends, and
# the same export against a real `mlflow server` where the full package is installed.

GET_BY_NAME = "GET /api/2.0/mlflow/experiments/get-by-name"
CREATE_EXPERIMENT = "POST /api/2.0/mlflow/experiments/create"
GET_RUN = "GET /api/2.0/mlflow/runs/get"
SEARCH_RUNS = "POST /api/2.0/mlflow/runs/search"
CREATE_RUN = "POST /api/2.0/mlflow/runs/create"
UPDATE_RUN = "POST /api/2.0/mlflow/runs/update"
LOG_BATCH = "POST /api/2.0/mlflow/runs/log-batch"
LINK = "POST /api/2.0/mlflow/traces/link-to-run"
TRACE_INFO = "GET /api/3.0/mlflow/traces/{id}"
SET_TAG = "PATCH /api/2.0/mlflow/traces/{id}/tags"
VERSION = "GET /version"
SPANS = "POST /v1/traces"
TAG = "mlflow.traceTag."


@pytest.fixture
async def mlflow_server() -> AsyncIterator[tuple[FakeMlflowServer, str]]:
    """A fresh fake MLflow tracking server. MLflow caches each server's version (its lru_cache
    on `RestStore._get_server_version`, keyed by the URL) for the process: forgotten here, so
    a fake on the port of an earlier one is asked again, as a new server would be."""
    RestStore._get_server_version.cache_clear()
    fake = FakeMlflowServer()
    async with fake.serve() as url:
        yield fake, url


def calls(fake: FakeMlflowServer) -> list[tuple[str, int]]:
    """Every request as ("METHOD route", status answered), trace ids shown as {id}."""
    return [
        (re.sub(r"tr-[0-9a-f]{32}", "{id}", f"{r.method} {r.path}"), r.status)
        for r in fake.requests
    ]


def bodies(fake: FakeMlflowServer, route: str) -> list[Any]:
    return [r.body for r in fake.requests if f"{r.method} {r.path}" == route]


def wire_traces(fake: FakeMlflowServer) -> dict[str, list[ReceivedSpan]]:
    """The spans the server holds, by MLflow trace id: the root, then the rest by start time."""
    traces: dict[str, list[ReceivedSpan]] = {}
    for span in fake.spans.values():
        traces.setdefault(span.mlflow_trace_id, []).append(span)
    for spans in traces.values():
        spans.sort(key=lambda s: (s.parent_span_id is not None, s.start_time_unix_nano))
    return traces


def root_tags(root: ReceivedSpan) -> dict[str, Any]:
    return {k.removeprefix(TAG): v for k, v in root.attributes.items() if k.startswith(TAG)}


def assert_linked_after_sent(fake: FakeMlflowServer) -> None:
    """Each link-to-run names only traces whose spans the server already accepted."""
    sent: set[str] = set()
    for request in fake.requests:
        if isinstance(request.body, OtlpExport):
            sent.update(span.mlflow_trace_id for span in request.body.spans)
        elif f"{request.method} {request.path}" == LINK and request.status == 200:
            assert set(request.body["trace_ids"]) <= sent


async def test_http_path_exports_recorded_trajectories_over_otlp(
    fake_vllm: tuple[FakeVLLM, str],
    qwen_tokenizer: Any,
    tmp_path: Path,
    mlflow_server: tuple[FakeMlflowServer, str],
) -> None:
    """Recorded trajectories to an http:// tracking URI: the experiment is looked up, then
    created, by the project name, the run by the trajectories' experiment name; the spans go
    over OTLP with the experiment id header, one trace per trajectory (id from the
    record id), verl's tags on the root span, exact times, decoded text; then the traces are
    linked to the run, a late score is set as a tag, and the run ends when the proxy stops."""
    fake, url = mlflow_server
    _, upstream = fake_vllm
    exporter = MlflowExporter(url, "rl-project", None)
    settings = {"project": "rl-project", "token2text": True,
                "tokenizer": [str(ensure_qwen_tokenizer())]}  # fmt: skip
    async with (
        proxy_with(upstream, tmp_path, exporter, **settings) as (service, proxy),
        aiohttp.ClientSession() as http,
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        sent = await rollouts_a_and_b(http, proxy, service, qwen_tokenizer)
        messages, message, tool_call, ids, first, second = sent
        await service.flush()
        assert await asyncio.to_thread(post_reward, admin, score=0.5, trajectory_id="b") == (
            "exported"
        )
    records = {t["key"]["trajectory_id"]: t for t in trajectories(tmp_path)}
    a, b = records["a"], records["b"]
    trace_a, trace_b = trace_id_of(a["id"]), trace_id_of(b["id"])

    assert fake.unknown() == []
    [experiment_id] = [i for i, e in fake.experiments.items() if e["name"] == "rl-project"]
    run = fake.run_by_name(experiment_id, "grpo-7b")  # the default run: the experiment name
    run_id = run["info"]["run_id"]
    # Experiment and run once (then cached); the run ended by close(), which MLflow's client
    # precedes with a runs/get (to print the run's URL).
    assert [c for c in calls(fake) if "/experiments/" in c[0] or "/runs/" in c[0]] == [
        (GET_BY_NAME, 404), (CREATE_EXPERIMENT, 200), (SEARCH_RUNS, 200), (CREATE_RUN, 200),
        (LOG_BATCH, 200), (GET_RUN, 200), (UPDATE_RUN, 200),
    ]  # fmt: skip
    [summary] = bodies(fake, LOG_BATCH)  # step 1's summary, when the proxy stops
    assert summary["run_id"] == run_id
    assert {m["key"]: (m["value"], m["step"]) for m in summary["metrics"]} == {
        "trace_proxy/trajectories_seen": (2.0, 1),
        "trace_proxy/trajectories_kept": (2.0, 1),
        "trace_proxy/trajectories_dropped_by_sampler": (0.0, 1),
        "trace_proxy/calls_seen": (4.0, 1),
        "trace_proxy/calls_kept": (4.0, 1),
        "trace_proxy/calls_dropped_by_sampler": (0.0, 1),
    }
    assert bodies(fake, GET_BY_NAME) == [{"experiment_name": "rl-project"}]
    assert bodies(fake, CREATE_EXPERIMENT) == [{"name": "rl-project"}]
    [search] = bodies(fake, SEARCH_RUNS)
    assert search["experiment_ids"] == [experiment_id]
    assert search["filter"] == "attributes.run_name = 'grpo-7b'"
    [create] = bodies(fake, CREATE_RUN)
    assert (create["experiment_id"], create["run_name"]) == (experiment_id, "grpo-7b")
    assert create["tags"] == [
        {"key": "mlflow.source.name", "value": "trace-proxy"},
        {"key": "trace_proxy.name_digest", "value": digest("grpo-7b")},
    ]
    [update] = bodies(fake, UPDATE_RUN)
    assert (update["run_id"], update["status"]) == (run_id, "FINISHED")
    assert run["info"]["status"] == "FINISHED"

    # The spans: over OTLP (protobuf), with the experiment id, each span once.
    assert fake.exports
    assert [c for c in calls(fake) if c[0] == SPANS] == [(SPANS, 200)] * len(fake.exports)
    for export in fake.exports:
        assert export.headers[EXPERIMENT_HEADER] == experiment_id
        assert export.headers["Content-Type"] == "application/x-protobuf"
    sent = Counter((s.trace_id, s.span_id) for s in fake.received_spans())
    assert set(sent.values()) == {1}
    traces = wire_traces(fake)
    assert set(traces) == set(fake.traces) == {trace_a, trace_b}
    assert {t.experiment_id for t in fake.traces.values()} == {experiment_id}

    # A: the root, two generate calls, the tool call between them, and the second reply's tool
    # call cut by max_tokens (an error span).
    root, llm1, tool, llm2, _cut = traces[trace_a]
    assert [(s.name, s.attributes["mlflow.spanType"]) for s in traces[trace_a]] == [
        ("agent_loop", "AGENT"), ("generate", "LLM"), ("get_weather", "TOOL"),
        ("generate", "LLM"), ("tool", "TOOL"),
    ]  # fmt: skip
    assert root.trace_id == trace_a.removeprefix("tr-")
    assert root.parent_span_id is None
    assert {s.parent_span_id for s in (llm1, tool, llm2)} == {root.span_id}
    assert root_tags(root) == {
        "mlflow.traceName": "agent_loop", "step": "1", "sample_index": "0", "rollout_n": "0",
        "validate": "False", "experiment_name": "grpo-7b", "trajectory_id": "a",
        "reward": "1.0", "label.correct": "true",
    }  # fmt: skip
    assert not any(k.startswith(TAG) for s in (llm1, tool, llm2) for k in s.attributes)
    assert fake.traces[trace_a].tags == root_tags(root)  # what the server makes of them
    assert fake.traces[trace_a].state == "OK"
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (ns(a["start"]), ns(a["end"]))
    for span, call in zip((llm1, llm2), a["calls"], strict=True):
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (
            ns(call["start"]), ns(call["end"])
        )  # fmt: skip
        assert span.attributes["mlflow.llm.model"] == "tiny-qwen"
        assert span.status_code == "STATUS_CODE_OK"
    tool_record, _ = a["tools"]
    assert (tool.start_time_unix_nano, tool.end_time_unix_nano) == (
        ns(tool_record["start"]), ns(tool_record["end"])
    )  # fmt: skip
    assert llm1.attributes["mlflow.spanInputs"] == {
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": TOOLS,
        "sampling_params": {"max_tokens": 40},
    }
    assert llm2.attributes["mlflow.spanInputs"]["messages"][-1] == messages[-1]
    outputs1 = llm1.attributes["mlflow.spanOutputs"]
    assert outputs1["choices"][0]["message"]["tool_calls"] == message["tool_calls"]
    assert outputs1["usage"] == a["calls"][0]["usage"]
    assert tool.attributes["mlflow.spanInputs"] == {"city": "Paris"}
    assert tool.attributes["mlflow.spanOutputs"] == "18C"
    assert tool.attributes["call_id"] == tool_call["id"]
    assert root.attributes["mlflow.spanInputs"] == {
        "messages": [{"role": "user", "content": QUESTION}]
    }
    assert root.attributes["mlflow.spanOutputs"]["reward"] == 1.0

    # B: two turns of token ids, with the decoded text.
    root, turn1, turn2 = traces[trace_b]
    assert [s.attributes["mlflow.spanType"] for s in (root, turn1, turn2)] == [
        "AGENT", "LLM", "LLM"
    ]  # fmt: skip
    assert root_tags(root) == {
        "mlflow.traceName": "agent_loop", "step": "1", "sample_index": "1", "rollout_n": "0",
        "validate": "False", "experiment_name": "grpo-7b", "trajectory_id": "b",
    }  # fmt: skip
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (ns(b["start"]), ns(b["end"]))
    text1 = qwen_tokenizer.decode(first)
    inputs1, inputs2 = (s.attributes["mlflow.spanInputs"] for s in (turn1, turn2))
    assert inputs1["prompt_text"] == CHATML
    assert turn1.attributes["mlflow.spanOutputs"]["choices"][0]["response_text"] == text1
    assert turn1.attributes["mlflow.spanOutputs"]["choices"][0]["token_ids"] == first
    assert inputs2["prompt_ids"] == ids  # the whole prompt, not the shared suffix
    assert inputs2["prompt_text"] == CHATML + text1 + MORE
    assert root.attributes["mlflow.spanOutputs"]["transcript"] == (
        CHATML + text1 + MORE + qwen_tokenizer.decode(second)
    )

    # Linked to the run, once each, after the server had them.
    assert sorted(fake.links[run_id]) == sorted([trace_a, trace_b])
    assert sorted(t for body in bodies(fake, LINK) for t in body["trace_ids"]) == sorted(
        [trace_a, trace_b]
    )
    assert {body["run_id"] for body in bodies(fake, LINK)} == {run_id}
    assert_linked_after_sent(fake)
    # The late score: the trace is asked for, then tagged.
    info_then_tag = [c for c in calls(fake) if c[0] in (TRACE_INFO, SET_TAG)]
    assert info_then_tag == [(TRACE_INFO, 200), (SET_TAG, 200)]
    assert bodies(fake, f"PATCH /api/2.0/mlflow/traces/{trace_b}/tags") == [
        {"key": "score", "value": "0.5"}
    ]
    assert fake.traces[trace_b].tags["score"] == "0.5"
    assert "score" not in fake.traces[trace_a].tags


async def test_http_path_run_by_id_or_name_summaries_and_late_rewards(
    mlflow_server: tuple[FakeMlflowServer, str],
) -> None:
    """`--mlflow-run` as the id of an existing run: used as is (not searched, not created, not
    ended); as a name: found, or created (quoted either way); step summaries as metrics; a late
    reward tags an exported trace and skips one the server does not have."""
    fake, url = mlflow_server
    experiment_id = fake.add_experiment("runs")
    trainer = fake.add_run(experiment_id, "trainer")

    by_id = MlflowExporter(url, "runs", trainer)
    summary = StepSummary(project="runs", experiment="exp", step=3, validate=False,
                          trajectories_seen=8, trajectories_kept=2, calls_seen=5)  # fmt: skip
    await asyncio.to_thread(by_id.export, [trajectory("11" * 16, 3), summary])
    note = Annotation(project="runs", experiment="exp", step=3, validate=True,
                      target={"trajectory_id": "t"}, trajectories=["11" * 16, "9" * 32],
                      time=0.0, reward=-1.0, labels={"ok": False})  # fmt: skip
    await asyncio.to_thread(by_id.export, [note])
    await asyncio.to_thread(by_id.close)

    assert fake.unknown() == []
    assert [c for c in calls(fake) if c[0] != VERSION] == [
        (GET_BY_NAME, 200), (GET_RUN, 200), (SPANS, 200), (LINK, 200), (LOG_BATCH, 200),
        (TRACE_INFO, 200), (SET_TAG, 200), (SET_TAG, 200), (TRACE_INFO, 404),
    ]  # fmt: skip
    assert bodies(fake, GET_RUN) == [{"run_uuid": trainer, "run_id": trainer}]
    assert [e.headers[EXPERIMENT_HEADER] for e in fake.exports] == [experiment_id]
    assert bodies(fake, LINK) == [{"trace_ids": ["tr-" + "11" * 16], "run_id": trainer}]
    assert fake.runs[trainer]["info"]["status"] == "RUNNING"  # not ours to end
    [batch] = bodies(fake, LOG_BATCH)
    assert batch["run_id"] == trainer
    assert {m["key"]: (m["value"], m["step"]) for m in batch["metrics"]} == {
        "trace_proxy/trajectories_seen": (8.0, 3),
        "trace_proxy/trajectories_kept": (2.0, 3),
        "trace_proxy/trajectories_dropped_by_sampler": (0.0, 3),
        "trace_proxy/calls_seen": (5.0, 3),
        "trace_proxy/calls_kept": (0.0, 3),
        "trace_proxy/calls_dropped_by_sampler": (0.0, 3),
    }
    root, generate, tool = wire_traces(fake)["tr-" + "11" * 16]
    assert root_tags(root) == {"mlflow.traceName": "agent_loop", "step": "3",
                               "validate": "True", "experiment_name": "exp"}  # fmt: skip
    assert [s.attributes["mlflow.spanType"] for s in (root, generate, tool)] == [
        "AGENT", "LLM", "TOOL"
    ]  # fmt: skip
    assert generate.start_time_unix_nano == 1_700_000_000_000_001_000
    assert (tool.start_time_unix_nano, tool.end_time_unix_nano) == (
        1_700_000_000_500_000_000, 1_700_000_000_750_000_000  # never answered: ends with it
    )  # fmt: skip
    assert generate.attributes["mlflow.spanInputs"] == {"prompt": "2+2=", "sampling_params": {}}
    assert tool.attributes["mlflow.spanInputs"] == {"arguments": "[1, 2]"}
    assert fake.traces["tr-" + "11" * 16].tags["reward"] == "-1.0"
    assert fake.traces["tr-" + "11" * 16].tags["label.ok"] == "false"
    assert "tr-" + "9" * 32 not in fake.traces

    # A run name: an existing run is found (newest first); a new name is created, quoted.
    fake.requests.clear()
    for name in ("trainer", "it's"):
        by_name = MlflowExporter(url, "runs", name)
        await asyncio.to_thread(by_name.export, [trajectory("22" * 16, 4)])
        await asyncio.to_thread(by_name.close)
    assert [b["filter"] for b in bodies(fake, SEARCH_RUNS)] == [
        "attributes.run_name = 'trainer'", "attributes.run_name = \"it's\""
    ]  # fmt: skip
    assert [b["run_name"] for b in bodies(fake, CREATE_RUN)] == ["it's"]
    quoted = fake.run_by_name(experiment_id, "it's")["info"]["run_id"]
    assert [(b["run_id"], b["trace_ids"]) for b in bodies(fake, LINK)] == [
        (trainer, ["tr-" + "22" * 16]), (quoted, ["tr-" + "22" * 16])
    ]  # fmt: skip
    assert [b["run_id"] for b in bodies(fake, UPDATE_RUN)] == [quoted]  # only the one it made

    # A deleted experiment is not silently recreated, and its records are dropped, not retried
    # until someone restores it: any request can name one, and the others would wait.
    fake.add_experiment("gone", lifecycle_stage="deleted")
    with pytest.raises(ExportRejected, match="is deleted"):
        await asyncio.to_thread(
            MlflowExporter(url, "gone", None).export, [trajectory("33" * 16, 1, "gone")]
        )
    assert fake.unknown() == []


async def test_http_path_failures_raise_and_the_retry_delivers_each_span_once(
    mlflow_server: tuple[FakeMlflowServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server failure makes export() raise, so the pipeline retries the batch; after
    recovery every span arrives once per span id and every trace is linked once. MLflow's own
    retries (7, with backoff: minutes) are turned off, so each failure reaches export()."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    fake, url = mlflow_server
    exporter = MlflowExporter(url, "flaky", None)
    batch: list[Any] = [failed("66" * 16, "flaky"), trajectory("77" * 16, 1, "flaky")]
    expected = {"tr-" + "66" * 16, "tr-" + "77" * 16}

    # The server's version (asked before the first spans) fails: transient, as any failure.
    fake.fail(VERSION, 503)
    with pytest.raises(NotImplementedError, match="server version"):
        await asyncio.to_thread(exporter.export, batch)
    # The spans are refused.
    fake.recover()
    fake.fail(SPANS, 503)
    with pytest.raises(MlflowException):
        await asyncio.to_thread(exporter.export, batch)
    assert [c for c in calls(fake) if c[0] in (VERSION, SPANS)] == [
        (VERSION, 503), (VERSION, 200), (SPANS, 503)
    ]  # fmt: skip
    assert fake.exports == [] and fake.traces == {} and bodies(fake, LINK) == []

    fake.recover()
    await asyncio.to_thread(exporter.export, batch)
    assert fake.unknown() == []  # no fallback to other routes (trace artifacts)
    assert [c for c in calls(fake) if c[0] in (VERSION, SPANS, LINK)] == [
        (VERSION, 503), (VERSION, 200), (SPANS, 503), (SPANS, 200), (LINK, 200)
    ]  # fmt: skip
    sent = Counter((s.mlflow_trace_id, s.span_id) for s in fake.received_spans())
    assert set(sent.values()) == {1} and len(sent) == 6  # 3 spans per trajectory, once each
    [experiment_id] = [i for i, e in fake.experiments.items() if e["name"] == "flaky"]
    assert [e.headers[EXPERIMENT_HEADER] for e in fake.exports] == [experiment_id]
    assert set(fake.traces) == expected
    assert fake.traces["tr-" + "66" * 16].state == "ERROR"
    [run_id] = fake.links
    assert sorted(fake.links[run_id]) == sorted(expected)
    assert_linked_after_sent(fake)
    _, generate, _ = wire_traces(fake)["tr-" + "66" * 16]
    assert (generate.status_code, generate.status_message) == (
        "STATUS_CODE_ERROR", "http_503: overloaded"
    )  # fmt: skip

    # The link fails after the spans were accepted: the retry sends the same span ids again
    # (the server keeps one of each) and links.
    fake.fail(LINK, 503)
    with pytest.raises(MlflowException):
        await asyncio.to_thread(exporter.export, batch)
    fake.recover()
    await asyncio.to_thread(exporter.export, batch)
    resent = Counter((s.mlflow_trace_id, s.span_id) for s in fake.received_spans())
    assert set(resent) == set(sent) and set(resent.values()) == {3}  # once, then twice more
    assert len(fake.spans) == 6 and set(fake.traces) == expected
    assert [c for c in calls(fake) if c[0] == LINK] == [(LINK, 200), (LINK, 503), (LINK, 200)]
    assert sorted(fake.links[run_id]) == sorted(expected)
    # The experiment and the run were made once, whatever failed after.
    assert [c for c in calls(fake) if c[0] in (GET_BY_NAME, CREATE_EXPERIMENT, CREATE_RUN)] == [
        (GET_BY_NAME, 404), (CREATE_EXPERIMENT, 200), (CREATE_RUN, 200)
    ]  # fmt: skip


def _mlflow_server_missing() -> str | None:
    """Why `mlflow server` cannot run here; None when it can."""
    try:
        importlib.metadata.version("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return (
            f"the full `mlflow` package is not installed (mlflow-skinny {mlflow.__version__} "
            "has the `mlflow server` command and `mlflow.server`, but not flask, which the "
            "server needs): only the fake server is tested"
        )
    if importlib.util.find_spec("mlflow.server") is None or shutil.which("mlflow") is None:
        return "no `mlflow` command or `mlflow.server` module"
    if importlib.util.find_spec("flask") is None:
        return "flask is not installed: `mlflow server` cannot start"
    return None


MLFLOW_SERVER_MISSING = _mlflow_server_missing()


@contextlib.asynccontextmanager
async def real_mlflow_server(directory: Path) -> AsyncIterator[str]:
    """`mlflow server` on a free port, with a sqlite store in `directory`; its URL once it
    answers /health (it takes ~25 s to start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log_path = directory / "mlflow-server.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            shutil.which("mlflow") or "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            cwd=directory, stdout=log, stderr=log,
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
        )  # fmt: skip
    try:
        deadline = asyncio.get_running_loop().time() + 120
        async with aiohttp.ClientSession() as http:
            while True:
                assert process.returncode is None, log_path.read_text(errors="replace")
                assert asyncio.get_running_loop().time() < deadline, "mlflow server not ready"
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(2)) as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.25)  # polling /health: the server says when it is ready
        yield url
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


@pytest.mark.skipif(MLFLOW_SERVER_MISSING is not None, reason=MLFLOW_SERVER_MISSING or "")
async def test_http_path_against_a_real_mlflow_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same export to a real `mlflow server`, read back with MLflow's own search: the tags
    ride on the root span and become trace tags, the traces are linked to the run."""
    RestStore._get_server_version.cache_clear()
    async with real_mlflow_server(tmp_path) as url:
        exporter = MlflowExporter(url, "real-server", None)
        batch: list[Any] = [trajectory("ab" * 16, 1, "real-server"),
                            failed("cd" * 16, "real-server")]  # fmt: skip
        await asyncio.to_thread(exporter.export, batch)
        await asyncio.to_thread(exporter.close)

        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        client = MlflowClient(url)
        experiment_id = client.get_experiment_by_name("real-server").experiment_id
        [run] = client.search_runs([experiment_id])
        assert (run.info.run_name, run.info.status) == ("exp", "FINISHED")
        found = await asyncio.to_thread(
            mlflow.search_traces, locations=[experiment_id], filter_string="tags.step = '1'",
            return_type="list",
        )  # fmt: skip
        assert [t.info.trace_id for t in found] == ["tr-" + "ab" * 16]
        linked = await asyncio.to_thread(
            mlflow.search_traces, locations=[experiment_id], run_id=run.info.run_id,
            return_type="list",
        )  # fmt: skip
        assert {t.info.trace_id for t in linked} == {"tr-" + "ab" * 16, "tr-" + "cd" * 16}

        trace = await asyncio.to_thread(mlflow.get_trace, "tr-" + "ab" * 16)
        assert {"step": "1", "validate": "True", "experiment_name": "exp"}.items() <= (
            trace.info.tags.items()
        )
        assert trace.info.state.value == "OK"
        root, generate, tool = trace.data.spans
        assert [(s.name, s.span_type) for s in trace.data.spans] == [
            ("agent_loop", "AGENT"), ("generate", "LLM"), ("calc", "TOOL")
        ]  # fmt: skip
        assert root.parent_id is None
        assert {generate.parent_id, tool.parent_id} == {root.span_id}
        assert (root.start_time_ns, root.end_time_ns) == (
            1_700_000_000_000_001_000, 1_700_000_000_750_000_000
        )  # fmt: skip
        assert generate.inputs == {"prompt": "2+2=", "sampling_params": {}}
        errored = await asyncio.to_thread(mlflow.get_trace, "tr-" + "cd" * 16)
        assert errored.info.state.value == "ERROR"
        assert errored.info.tags["step"] == "7"


async def test_traces_carry_policy_versions_and_lag(
    qwen_tokenizer: Any, tmp_path: Path, tracking_uri: str
) -> None:
    """A partial rollout resumed across a weight sync and a rollout on one version, closed one
    sync later (tests/support/version_workload.py): each root span's attributes say the sample id,
    the oldest, newest and newest-seen versions, their spread, the lag and the partial flag,
    and each generate span its version and lag, as the other backends say them."""
    exporter = MlflowExporter(tracking_uri, "async-project", None)
    async with (
        version_workload.upstream(qwen_tokenizer) as upstream,
        proxy_with(upstream, tmp_path, exporter, project="async-project") as (_, proxy),
        aiohttp.ClientSession() as http,
    ):
        await version_workload.partial_rollouts(http, proxy, qwen_tokenizer)
    records = version_workload.by_sample(trajectories(tmp_path))
    for sample, record in records.items():
        low, high, latest, partial, sample_id = version_workload.EXPECTED[sample]
        root, generate = mlflow.get_trace(trace_id_of(record["id"])).data.spans
        assert {name: root.get_attribute(name) for name in (
            "sample_id", "weight_version_min", "weight_version_max", "weight_version_latest",
            "partial_rollout", "version_spread", "version_lag")} == {
            "sample_id": sample_id, "weight_version_min": low, "weight_version_max": high,
            "weight_version_latest": latest, "partial_rollout": partial,
            "version_spread": int(high) - int(low), "version_lag": 1,
        }  # fmt: skip
        assert generate.get_attribute("weight_version") == "4"
        assert generate.get_attribute("version_lag") == 1
    segments = (
        mlflow.get_trace(trace_id_of(records[0]["id"])).data.spans[1].get_attribute("segments")
    )
    assert [s["weight_version"] for s in segments] == ["3", "4"]
