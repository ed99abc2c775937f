"""The otlp backend: trajectories recorded by a real proxy become GenAI span trees, in memory and
over the wire (a local OTLP/HTTP receiver decoding the protobuf), and a receiver that refuses or
is down makes export() raise, so the pipeline retries without re-sending what arrived."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import FakeVLLM
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support import version_workload
from support.proxies import closed_port, inline_pipeline, scripted_upstream

from trace_proxy.client import post_reward
from trace_proxy.config import Settings
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.exporters import BACKENDS
from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.exporters.backends.otlp import (
    REJECTED_STATUSES,
    OtlpExporter,
    OtlpExportError,
    parse_headers,
)
from trace_proxy.exporters.base import Exporter
from trace_proxy.proxy.service import ProxyService
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.prompts import share_prefixes
from trace_proxy.trajectories.record import (
    Annotation,
    CallError,
    GenerateCall,
    Output,
    Prompt,
    Record,
    RolloutKey,
    StepSummary,
    ToolCall,
    Trajectory,
)

Json = dict[str, Any]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATML = "<|im_start|>user\nSay something nice.<|im_end|>\n<|im_start|>assistant\n"
NEXT_TURN = "<|im_end|>\n<|im_start|>user\nAnd once more.<|im_end|>\n<|im_start|>assistant\n"
CHAT_KEY = {"X-Rollout-Experiment": "grpo", "X-Rollout-Step": "1",
            "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0"}  # fmt: skip
TOKEN_KEY = {"X-Rollout-Experiment": "grpo", "X-Rollout-Step": "1", "X-Rollout-Sample-Index": "1",
             "X-Rollout-N": "2", "X-Rollout-Validate": "true"}  # fmt: skip
TOOL_RESULT = '{"temp_c": 18}'


class Keep(Exporter):
    """A backend that keeps the records it is given, to export them again in other tests."""

    name = "keep"

    def __init__(self) -> None:
        self.records: list[Record] = []

    def export(self, records: list[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Recorded:
    records: list[Record]  # as the pipeline handed them to every backend
    stored: list[Json]  # the same records, as the jsonl store wrote them
    spans: tuple[ReadableSpan, ...]  # what the otlp backend produced, in memory
    prompt_ids: list[list[int]]  # the token dialect's full prompts, as sent

    def trajectory(self, **key: Any) -> Json:
        [found] = [
            r for r in self.stored
            if r["record"] == "trajectory" and all(r["key"][k] == v for k, v in key.items())
        ]  # fmt: skip
        return found


@pytest.fixture(scope="module")
async def recorded(qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """One proxy run, exported to jsonl and (in memory) to otlp: a chat rollout with a tool
    call, a two-turn token rollout decoded by token2text with a reward, a failed call, and a
    pause/resume of the server."""
    output = tmp_path_factory.mktemp("otlp")
    memory = InMemorySpanExporter()
    keep = Keep()
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    async with fake.serve() as upstream:
        settings = dataclasses.replace(
            Settings(), upstream=[upstream], port=0, admin_port=0, output=output,
            token2text=True, tokenizer=[str(ensure_qwen_tokenizer())],
        )  # fmt: skip
        otlp = OtlpExporter("http://127.0.0.1:9/v1/traces", {}, span_exporter=memory)
        service = ProxyService(settings, exporters=[JsonlExporter(output), keep, otlp])
        addresses = await service.start()
        try:
            async with aiohttp.ClientSession() as session:
                await chat_rollout(session, addresses.proxy)
                prompt_ids = await token_rollout(session, addresses.proxy, qwen_tokenizer)
                await failing_call(session, addresses.proxy)
                for path in ("/pause", "/resume"):
                    async with session.post(addresses.proxy + path) as response:
                        assert response.status == 200
            await service.flush()
            assert addresses.admin is not None
            where = await asyncio.to_thread(
                post_reward, addresses.admin, reward=0.5, labels={"correct": True},
                experiment="grpo", step=1, sample_index=1, rollout_n=2, validate=True,
            )  # fmt: skip
            assert where == "open"
        finally:
            await service.stop()
    stored = [r for _, r in iter_records(output)]
    return Recorded(keep.records, stored, memory.get_finished_spans(), prompt_ids)


async def chat_rollout(session: aiohttp.ClientSession, proxy: str) -> None:
    messages: list[Json] = [{"role": "user", "content": "Weather in Paris and Berlin?"}]
    body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS, "temperature": 0.7,
            "top_p": 0.9, "max_tokens": 64, "seed": 7, "stop": ["</s>"]}  # fmt: skip
    async with session.post(proxy + "/v1/chat/completions", json=body, headers=CHAT_KEY) as r:
        message = (await r.json())["choices"][0]["message"]
    [tool_call] = message["tool_calls"]
    messages += [message, {"role": "tool", "tool_call_id": tool_call["id"], "content": TOOL_RESULT}]
    body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with session.post(proxy + "/v1/chat/completions", json=body, headers=CHAT_KEY) as r:
        assert r.status == 200
        await r.read()


async def token_rollout(
    session: aiohttp.ClientSession, proxy: str, tokenizer: Any
) -> list[list[int]]:
    """Two turns of vLLM's token-in/token-out API, the second extending the first."""
    prompts = [tokenizer.encode(CHATML)]
    for turn in range(2):
        body = {"model": "tiny-qwen", "token_ids": prompts[-1],
                "sampling_params": {"max_tokens": 8, "temperature": 1.0, "n": 1}}  # fmt: skip
        async with session.post(proxy + "/inference/v1/generate", json=body,
                                headers=TOKEN_KEY) as response:  # fmt: skip
            reply = await response.json()
        if turn == 0:
            said = reply["choices"][0]["token_ids"]
            prompts.append(prompts[0] + said + tokenizer.encode(NEXT_TURN))
    return prompts


async def failing_call(session: aiohttp.ClientSession, proxy: str) -> None:
    body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Hi"}], "tools": []}
    headers = {"X-Rollout-Trajectory-Id": "broken"}
    async with session.post(proxy + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 400


def ns(seconds: float) -> int:
    """Epoch seconds to nanoseconds, the float's exact value rounded to the nearest ns."""
    return int((Decimal(seconds) * 1_000_000_000).to_integral_value())


def by_trace(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    traces: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        assert span.context is not None
        traces.setdefault(span.context.trace_id, []).append(span)
    return traces


def tree(spans: list[ReadableSpan]) -> tuple[ReadableSpan, list[ReadableSpan], list[ReadableSpan]]:
    """The root, its generate-call children (in call order) and its tool children."""
    [root] = [s for s in spans if s.parent is None]
    assert root.context is not None
    children = [s for s in spans if s.parent is not None]
    assert all(s.parent.span_id == root.context.span_id for s in children)  # type: ignore[union-attr]
    calls = [s for s in children if attrs(s)["gen_ai.operation.name"] != "execute_tool"]
    tools = [s for s in children if attrs(s)["gen_ai.operation.name"] == "execute_tool"]
    calls.sort(key=lambda s: attrs(s)["trace_proxy.call.index"])
    tools.sort(key=lambda s: attrs(s)["trace_proxy.tool.index"])
    return root, calls, tools


def attrs(span: ReadableSpan) -> Json:
    return dict(span.attributes or {})


def times(span: ReadableSpan) -> tuple[int | None, int | None]:
    return span.start_time, span.end_time


def messages(span: ReadableSpan, kind: str) -> Any:
    return json.loads(attrs(span)[f"gen_ai.{kind}.messages"])


def text(content: str, role: str = "user") -> Json:
    return {"role": role, "parts": [{"type": "text", "content": content}]}


async def test_a_chat_rollout_is_an_agent_span_with_chat_and_tool_children(
    recorded: Recorded,
) -> None:
    t = recorded.trajectory(sample_index=0)
    spans = by_trace(recorded.spans)[int(t["id"], 16)]  # the trace id is the record id
    root, calls, tools = tree(spans)
    assert len(spans) == 1 + len(t["calls"]) + len(t["tools"])
    assert root.name == "invoke_agent agent_loop"
    assert times(root) == (ns(t["start"]), ns(t["end"]))
    assert [s.name for s in calls] == ["chat tiny-qwen", "chat tiny-qwen"]
    for span, call in zip(calls, t["calls"], strict=True):
        assert times(span) == (ns(call["start"]), ns(call["end"]))
        [event] = span.events
        assert (event.name, event.timestamp) == ("first_byte", ns(call["first_byte"]))
        assert span.kind is trace.SpanKind.CLIENT
        assert span.status.status_code is StatusCode.UNSET
        a = attrs(span)
        assert a["gen_ai.response.id"] == call["request_id"]
        assert a["gen_ai.usage.input_tokens"] == call["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == call["usage"]["completion_tokens"]
        assert a["gen_ai.response.finish_reasons"] == ("tool_calls",)  # asks for a tool
        assert a["gen_ai.request.stream"] is call["stream"]
        assert a["gen_ai.conversation.id"] == t["id"]
        assert "gen_ai.provider.name" not in a  # the OpenAI API does not say which server
    first, second = (attrs(s) for s in calls)
    assert {k: v for k, v in first.items() if k.startswith("gen_ai.request.")} == {
        "gen_ai.request.model": "tiny-qwen", "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9, "gen_ai.request.max_tokens": 64,
        "gen_ai.request.seed": 7, "gen_ai.request.stop_sequences": ("</s>",),
        "gen_ai.request.stream": False,
    }  # fmt: skip
    assert first["gen_ai.response.model"] == "tiny-qwen"
    assert json.loads(first["gen_ai.tool.definitions"]) == TOOLS
    assert json.loads(second["gen_ai.tool.definitions"]) == TOOLS  # shared: stored once
    [asked] = t["calls"][0]["outputs"][0]["tool_calls"]
    tool_call = {"type": "tool_call", "id": asked["id"], "name": "get_weather",
                 "arguments": {"city": "Paris"}}  # fmt: skip
    assert messages(calls[0], "input") == [text("Weather in Paris and Berlin?")]
    assert messages(calls[0], "output") == [
        {"role": "assistant", "parts": [tool_call], "finish_reason": "tool_calls"}
    ]
    # The second prompt is stored as a suffix of the first; the span carries all of it.
    assert messages(calls[1], "input") == [
        text("Weather in Paris and Berlin?"),
        {"role": "assistant", "parts": [tool_call]},
        {"role": "tool", "parts": [
            {"type": "tool_call_response", "id": asked["id"], "response": TOOL_RESULT}]},
    ]  # fmt: skip

    answered, unanswered = tools
    tool = t["tools"][0]
    assert answered.name == "execute_tool get_weather"
    assert times(answered) == (ns(tool["start"]), ns(tool["end"]))
    assert times(answered) == (calls[0].end_time, calls[1].start_time)  # the agent's tool time
    assert {k: v for k, v in attrs(answered).items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
        "gen_ai.tool.call.id": asked["id"], "gen_ai.tool.call.arguments": '{"city": "Paris"}',
        "gen_ai.tool.call.result": TOOL_RESULT, "gen_ai.conversation.id": t["id"],
    }  # fmt: skip
    assert [link.context for link in answered.links] == [calls[0].context]
    assert t["tools"][1]["end"] is None  # asked for by the last response, never answered
    assert attrs(unanswered)["trace_proxy.tool.unanswered"] is True
    assert times(unanswered) == (ns(t["tools"][1]["start"]), root.end_time)

    a = attrs(root)
    assert {k: v for k, v in a.items() if k.startswith(("rollout.", "mlflow."))} == {
        "rollout.project": "default", "rollout.experiment": "grpo", "rollout.step": 1,
        "rollout.sample_index": 0, "rollout.n": 0, "rollout.record_id": t["id"],
        "rollout.part": 1, "rollout.status": "ok", "rollout.close_reason": "shutdown",
        "rollout.key_sources": json.dumps(t["key"]["sources"], separators=(",", ":")),
        "mlflow.traceTag.project": "default", "mlflow.traceTag.experiment": "grpo",
        "mlflow.traceTag.step": "1", "mlflow.traceTag.sample_index": "0",
        "mlflow.traceTag.rollout_n": "0", "mlflow.traceTag.record_id": t["id"],
        "mlflow.traceTag.part": "1", "mlflow.traceTag.status": "ok",
        "mlflow.traceTag.close_reason": "shutdown",
    }  # fmt: skip
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.agent.name"] == "agent_loop"
    assert a["gen_ai.conversation.id"] == t["id"]
    assert a["gen_ai.input.messages"] == first["gen_ai.input.messages"]
    assert a["gen_ai.output.messages"] == second["gen_ai.output.messages"]
    assert root.resource.attributes["service.name"] == "trace-proxy"
    assert root.instrumentation_scope is not None
    assert root.instrumentation_scope.name == "trace_proxy.exporters.otlp"
    # A tracer provider of its own: the process-wide one was never set.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


async def test_a_token_rollout_carries_the_decoded_text_reward_and_validate_tag(
    recorded: Recorded, qwen_tokenizer: Any
) -> None:
    t = recorded.trajectory(sample_index=1)
    root, calls, tools = tree(by_trace(recorded.spans)[int(t["id"], 16)])
    assert tools == []
    assert [s.name for s in calls] == ["text_completion tiny-qwen"] * 2
    assert t["calls"][1]["prompt"]["prefix_call"] == 0  # stored as a suffix of turn one
    for span, call, prompt_ids in zip(calls, t["calls"], recorded.prompt_ids, strict=True):
        a = attrs(span)
        assert times(span) == (ns(call["start"]), ns(call["end"]))
        assert a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.temperature"] == 1.0 and a["gen_ai.request.max_tokens"] == 8
        assert "gen_ai.request.choice.count" not in a  # n == 1
        # The whole prompt, decoded, even where the record stores only the new suffix.
        assert messages(span, "input") == [text(qwen_tokenizer.decode(prompt_ids))]
        [output] = call["outputs"]
        assert messages(span, "output") == [{
            "role": "assistant", "parts": [{"type": "text", "content": output["response_text"]}],
            "finish_reason": output["finish_reason"],
        }]  # fmt: skip
    assert messages(calls[0], "input") == [text(CHATML)]
    a = attrs(root)
    assert a["gen_ai.provider.name"] == "vllm"
    assert (a["rollout.validate"], a["mlflow.traceTag.validate"]) == (True, "true")
    assert (a["rollout.n"], a["mlflow.traceTag.rollout_n"]) == (2, "2")
    assert (a["rollout.reward"], a["mlflow.traceTag.reward"]) == (0.5, "0.5")
    assert json.loads(a["rollout.labels"]) == {"correct": True}
    assert "rollout.score" not in a and "mlflow.traceTag.score" not in a


async def test_errors_events_and_records_that_are_not_traces(recorded: Recorded) -> None:
    traces = by_trace(recorded.spans)
    t = recorded.trajectory(trajectory_id="broken")
    root, [call], [] = tree(traces[int(t["id"], 16)])
    error = t["calls"][0]["error"]
    assert error["type"] == "http_400" and "tools" in error["message"]
    assert call.status.status_code is StatusCode.ERROR
    assert call.status.description == f"{error['type']}: {error['message']}"
    assert attrs(call)["error.type"] == "http_400"
    assert attrs(call)["http.response.status_code"] == 400
    assert root.status.status_code is StatusCode.ERROR
    assert error["message"] in (root.status.description or "")
    assert attrs(root)["gen_ai.conversation.id"] == "broken"  # the client's trajectory id
    assert attrs(root)["mlflow.traceTag.trajectory_id"] == "broken"

    events = [r for r in recorded.stored if r["record"] == "event"]
    assert [e["event"] for e in events] == ["pause", "resume"]
    singles = [spans for spans in traces.values() if spans[0].name.startswith("step_event")]
    assert len(singles) == len(events)
    for [span], event in zip(sorted(singles, key=lambda s: s[0].start_time or 0), events,
                             strict=True):  # fmt: skip
        assert span.name == f"step_event {event['event']}" and span.parent is None
        assert times(span) == (ns(event["time"]), ns(event["time"]))
        assert attrs(span)["mlflow.traceTag.event"] == event["event"]
        assert attrs(span)["trace_proxy.route"] == event["route"]

    summaries = [r for r in recorded.stored if r["record"] == "step_summary"]
    assert summaries  # exported to jsonl, skipped by otlp
    stored = [r for r in recorded.stored if r["record"] == "trajectory"]
    expected = sum(1 + len(r["calls"]) + len(r["tools"]) for r in stored) + len(events)
    assert len(recorded.spans) == expected


@dataclasses.dataclass
class Received:
    headers: dict[str, str]
    request: ExportTraceServiceRequest
    status: int


@contextlib.asynccontextmanager
async def receiver(
    statuses: list[int] | None = None,
    refuse: Callable[[ExportTraceServiceRequest], int | None] | None = None,
) -> AsyncIterator[tuple[str, list[Received]]]:
    """A local OTLP/HTTP traces endpoint; answers the given statuses in turn, then 200 (or
    what `refuse` says of a request, when it says something)."""
    statuses = list(statuses or [])
    received: list[Received] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        assert request.path == "/v1/traces" and request.method == "POST"
        assert request.content_type == "application/x-protobuf"
        decoded = ExportTraceServiceRequest.FromString(await request.read())
        refused = refuse(decoded) if refuse is not None else None
        status = statuses.pop(0) if statuses else refused or 200
        received.append(Received({k.lower(): v for k, v in request.headers.items()}, decoded,
                                 status))  # fmt: skip
        if status != 200:
            # Retry-After beyond the exporter's 10 s timeout: it gives the refusal back at once.
            return web.Response(status=status, text="busy", headers={"Retry-After": "3600"})
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async with scripted_upstream(handle) as url:
        yield url + "/v1/traces", received


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    assert kind is not None
    if kind == "array_value":
        return tuple(value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind)


def _int(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def wire_spans(received: list[Received]) -> dict[tuple[int, int], tuple[Any, Json, Json]]:
    """(trace id, span id) -> (span, its attributes, its resource's attributes)."""
    spans = {}
    for item in received:
        if item.status != 200:
            continue
        for resource_spans in item.request.resource_spans:
            resource = {a.key: value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "trace_proxy.exporters.otlp"
                for span in scope_spans.spans:
                    key = (_int(span.trace_id), _int(span.span_id))
                    assert key not in spans, "a span arrived twice"
                    spans[key] = (span, {a.key: value(a.value) for a in span.attributes}, resource)
    return spans


async def test_the_same_spans_arrive_over_otlp_http_with_the_configured_headers(
    recorded: Recorded,
) -> None:
    async with receiver() as (url, received):
        settings = dataclasses.replace(
            Settings(), otlp_endpoint=url,
            otlp_header=["x-mlflow-experiment-id=12", "Authorization=Basic dXNlcjpwdw=="],
        )  # fmt: skip
        exporter = BACKENDS["otlp"](settings)
        try:
            await asyncio.to_thread(exporter.export, recorded.records)
        finally:
            await asyncio.to_thread(exporter.close)
    assert len(received) == 1  # one request for the batch
    assert received[0].headers["x-mlflow-experiment-id"] == "12"
    assert received[0].headers["authorization"] == "Basic dXNlcjpwdw=="
    arrived = wire_spans(received)
    assert len(arrived) == len(recorded.spans)
    for expected in recorded.spans:
        assert expected.context is not None
        span, attributes, resource = arrived[(expected.context.trace_id, expected.context.span_id)]
        parent = expected.parent.span_id if expected.parent is not None else None
        assert (_int(span.parent_span_id) or None) == parent
        assert span.name == expected.name
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == times(expected)
        assert attributes == attrs(expected)
        assert span.status.code == expected.status.status_code.value
        assert span.status.message == (expected.status.description or "")
        assert [(e.name, e.time_unix_nano) for e in span.events] == [
            (e.name, e.timestamp) for e in expected.events
        ]
        assert [_int(link.span_id) for link in span.links] == [
            link.context.span_id for link in expected.links
        ]
        assert resource["service.name"] == "trace-proxy"


async def test_a_refusing_or_absent_receiver_makes_export_raise(recorded: Recorded) -> None:
    async with receiver([503]) as (url, received):
        exporter = OtlpExporter(url, {})
        with pytest.raises(OtlpExportError):
            await asyncio.to_thread(exporter.export, recorded.records)
        await asyncio.to_thread(exporter.close)
    assert [r.status for r in received] == [503]

    # Nothing listening: a short timeout, or the exporter's own retry would back off for 10 s.
    down = f"http://127.0.0.1:{closed_port()}/v1/traces"
    exporter = OtlpExporter(down, {}, span_exporter=OTLPSpanExporter(down, timeout=0.5))
    with pytest.raises(OtlpExportError):
        await asyncio.to_thread(exporter.export, recorded.records)
    await asyncio.to_thread(exporter.close)


async def test_the_pipeline_retries_and_nothing_arrives_twice(
    recorded: Recorded, tmp_path: Path
) -> None:
    async with receiver([200, 503]) as (url, received):
        exporter = OtlpExporter(url, {})
        exporter.request_budget = 1  # a request per record: the second one is refused
        pipeline, metrics = inline_pipeline(tmp_path, [exporter])
        await pipeline.start()
        for record in recorded.records:
            pipeline.submit(record)
        await pipeline.flush()
        await pipeline.close()
    traces = [r for r in recorded.records if not isinstance(r, StepSummary | Annotation)]
    assert [r.status for r in received] == [200, 503] + [200] * (len(traces) - 1)
    assert len(wire_spans(received)) == len(recorded.spans)  # each span once
    sample = metrics.registry.get_sample_value
    assert sample("trace_proxy_export_retries_total", {"backend": "otlp"}) == 1
    exported = sample("trace_proxy_exported_records_total", {"backend": "otlp"})
    assert exported == len(recorded.records)  # summaries count too: handled, by skipping


@pytest.mark.parametrize("status", REJECTED_STATUSES)
async def test_a_record_the_receiver_refuses_for_good_is_dropped_and_counted_not_retried(
    recorded: Recorded, tmp_path: Path, status: int
) -> None:
    """A receiver that cannot take one trajectory's spans (bad request, too large, invalid)
    would refuse it on every retry, and every record behind it would wait in the spool: that
    record is dropped and counted as rejected, the others arrive once each."""
    traces = [r for r in recorded.records if isinstance(r, Trajectory)]
    poison = int(traces[1].id, 16)

    def refuse(request: ExportTraceServiceRequest) -> int | None:
        ids = {_int(s.trace_id) for rs in request.resource_spans for ss in rs.scope_spans
               for s in ss.spans}  # fmt: skip
        return status if poison in ids else None

    async with receiver(refuse=refuse) as (url, received):
        exporter = OtlpExporter(url, {})
        pipeline, metrics = inline_pipeline(tmp_path, [exporter])
        await pipeline.start()
        for record in recorded.records:
            pipeline.submit(record)
        await asyncio.wait_for(pipeline.flush(), 60)
        await pipeline.close()
    arrived = {trace for trace, _ in wire_spans(received)}  # each span once, or it fails
    kept = {int(t.id, 16) for t in traces} - {poison}
    assert kept <= arrived and poison not in arrived
    traced = [r for r in recorded.records if not isinstance(r, StepSummary | Annotation)]
    assert len(arrived) == len(traced) - 1  # the events too
    sample = metrics.registry.get_sample_value
    dropped = sample("trace_proxy_export_dropped_total", {"backend": "otlp", "reason": "rejected"})
    assert dropped == 1


def test_headers_are_name_value_pairs() -> None:
    assert parse_headers(["a=1", " Authorization = Basic x== "]) == {
        "a": "1", "Authorization": "Basic x==",
    }  # fmt: skip
    for bad in ("no-equals", "=value"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse_headers([bad])


def test_partly_shared_token_prompts_unanswered_and_failed_tools(qwen_tokenizer: Any) -> None:
    """A re-rendered turn shares only part of the context: the last call's prompt comes from
    the stored transcript, an earlier one sends its decoded suffix and says what it left out."""
    from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
    from trace_proxy.text.toolparsers import get_parser

    encode = qwen_tokenizer.encode
    said = "Sunny.<|im_end|>"
    rerendered = "Sunny!<|im_end|>"  # the agent re-renders the turn differently
    follow = "\n<|im_start|>user\nAnd Oslo?<|im_end|>\n<|im_start|>assistant\n"
    prompts = [encode(CHATML)]
    prompts.append(prompts[0] + encode(rerendered + follow))
    prompts.append(prompts[1] + encode("Cold.<|im_end|>" + follow))
    answers = [said, "Cold.<|im_end|>", "Done.<|im_end|>"]
    calls = [
        GenerateCall(
            index=i,
            dialect="sglang.generate",
            route="/generate",
            upstream="http://s:30000",
            start=10.0 + i,
            end=10.5 + i,
            prompt=Prompt(token_ids=ids),
            outputs=[Output(index=0, token_ids=encode(answer), finish_reason="stop")],
            sampling={"max_new_tokens": 16, "n": 2, "stop": "<|im_end|>"},
            usage={"prompt_tokens": len(ids), "completion_tokens": 3, "cached_tokens": 5},
        )
        for i, (ids, answer) in enumerate(zip(prompts, answers, strict=True))
    ]
    share_prefixes(calls)
    assert calls[1].prompt.prefix_len is not None  # part of turn one is shared
    tools = [
        ToolCall(index=0, observed="http_tool_server", start=10.6, end=10.9, name="sandbox",
                 arguments="{}", result="boom", route="/run", upstream="http://tools:8080",
                 http_status=500, error=CallError("http_5xx", "boom")),
        ToolCall(index=1, observed="parsed_from_text", start=12.5, end=None, name=None),
    ]  # fmt: skip
    trajectory = Trajectory(
        id="not-a-uuid", key=RolloutKey(project="p", experiment="e"), start=10.0, end=12.5,
        status="ok", close_reason="done", calls=calls, tools=tools,
    )  # fmt: skip
    tokenizers = Tokenizers()
    tokenizers.add(None, decoder_for(qwen_tokenizer, skip_special_tokens=False))
    Token2Text(tokenizers, get_parser("hermes")).process([trajectory])
    assert trajectory.transcript is not None  # the pieces do not spell it out

    memory = InMemorySpanExporter()
    exporter = OtlpExporter("http://unused", {}, span_exporter=memory)
    summary = StepSummary(project="p", experiment="e", step=None, validate=False)
    late = Annotation(project="p", experiment="e", step=None, validate=False, target={},
                      trajectories=[], time=1.0, reward=1.0)  # fmt: skip
    exporter.export([trajectory, summary, late])
    first_spans = memory.get_finished_spans()
    exporter.export([trajectory])  # exported again (a retry): the very same ids
    exporter.close()
    again = memory.get_finished_spans()[len(first_spans) :]
    assert [s.context for s in again] == [s.context for s in first_spans]

    root, spans, [failed, open_tool] = tree(list(first_spans))
    assert [s.name for s in spans] == ["text_completion"] * 3  # no model was named
    assert [attrs(s)["gen_ai.provider.name"] for s in spans] == ["sglang"] * 3
    a = attrs(spans[0])
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.request.choice.count"] == 2
    assert a["gen_ai.request.stop_sequences"] == ("<|im_end|>",)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 5
    decode = qwen_tokenizer.decode
    assert messages(spans[0], "input") == [text(CHATML)]
    middle = attrs(spans[1])
    assert middle["trace_proxy.prompt.prefix_call"] == 0
    omitted = middle["trace_proxy.prompt.omitted_prefix_tokens"]
    assert 0 < omitted < len(prompts[1])
    assert messages(spans[1], "input") == [text(decode(prompts[1][omitted:]))]
    assert messages(spans[2], "input") == [text(decode(prompts[2]))]
    assert "trace_proxy.prompt.prefix_call" not in attrs(spans[2])

    assert failed.name == "execute_tool sandbox"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "http_5xx: boom"
    assert attrs(failed)["server.address"] == "tools" and attrs(failed)["server.port"] == 8080
    assert open_tool.name == "execute_tool"
    assert times(open_tool) == (ns(12.5), ns(12.5))
    assert root.context is not None and root.context.trace_id != 0


async def test_spans_carry_policy_versions_and_lag_in_the_rl_namespace(
    qwen_tokenizer: Any, tmp_path: Path
) -> None:
    """A partial rollout resumed across a weight sync and a rollout on one version, closed one
    sync later (tests/support/version_workload.py): the root says the sample id, oldest, newest and
    newest-seen versions, their spread, the lag and the partial flag; each call its version
    and lag; each attempt (segment event) its version, carried and generated tokens."""
    output = tmp_path / "traces"
    memory = InMemorySpanExporter()
    async with version_workload.upstream(qwen_tokenizer) as upstream:
        settings = dataclasses.replace(
            Settings(), upstream=[upstream], port=0, admin_port=0, output=output
        )
        otlp = OtlpExporter("http://127.0.0.1:9/v1/traces", {}, span_exporter=memory)
        service = ProxyService(settings, exporters=[JsonlExporter(output), otlp])
        addresses = await service.start()
        try:
            async with aiohttp.ClientSession() as session:
                await version_workload.partial_rollouts(session, addresses.proxy, qwen_tokenizer)
        finally:
            await service.stop()
    records = version_workload.by_sample([r for _, r in iter_records(output)])
    roots = {}
    for spans in by_trace(memory.get_finished_spans()).values():
        root, calls, _ = tree(spans)
        if attrs(root).get("gen_ai.operation.name") == "invoke_agent":
            roots[attrs(root)["rollout.sample_index"]] = (root, calls)
    assert sorted(roots) == [0, 1]
    for sample, (root, calls) in roots.items():
        low, high, latest, partial, sample_id = version_workload.EXPECTED[sample]
        a = attrs(root)
        assert (a["rl.sample.id"], a["rl.policy.version_min"], a["rl.policy.version_max"],
                a["rl.policy.version_latest"], a["rl.rollout.partial"]) == (
            sample_id, low, high, latest, partial)  # fmt: skip
        assert (a["rl.policy.version_spread"], a["rl.policy.lag"]) == (int(high) - int(low), 1)
        [call] = calls
        assert (attrs(call)["rl.policy.version"], attrs(call)["rl.policy.lag"]) == ("4", 1)
    [resumed] = roots[0][1]
    segments = records[0]["calls"][0]["segments"]
    assert [
        (dict(e.attributes or {})["rl.policy.version"],
         dict(e.attributes or {})["trace_proxy.segment.carried_tokens"],
         dict(e.attributes or {})["trace_proxy.segment.tokens"])
        for e in resumed.events if e.name == "segment"
    ] == [(s["weight_version"], s["carried_tokens"], s["tokens"]) for s in segments]  # fmt: skip
    assert segments[0]["finish_reason"] == "abort"
