"""Each API dialect is declared once (trace_proxy/trajectories/dialects.py), and every part of
the proxy that treats dialects apart reads that declaration: capture parses exactly the declared
dialects, a call capture records is sent again by replay as it was asked, and replay, drift and
each trace backend name and send a call as its declaration says. So a dialect added with its
declaration and its parser needs nothing else, and one that lacks a piece fails here."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture import dialects as capture_dialects
from trace_proxy.capture.dialects import DIALECTS, PARSERS, PROMPT_IDS
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.routes import RouteKind, classify
from trace_proxy.exporters.backends import mlflow_traces, otlp_conventions, trackio
from trace_proxy.exporters.backends.spans import ROOT_NAME, trajectory_spans
from trace_proxy.replay.requests import NotReplayable, ReplayCall, replay_calls
from trace_proxy.text.drift import codec_for, known_prompt_ids
from trace_proxy.trajectories import dialects
from trace_proxy.trajectories.dialects import (
    BY_NAME,
    DECLARED,
    UNDECLARED,
    Dialect,
    Operations,
    dialect_named,
)
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    Trajectory,
    dumps,
)

# Weave decides when first imported whether it reports errors to Sentry (which hangs offline).
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
Json = dict[str, Any]
MAY_BE_NONE = {"prompt_ids", "provider"}  # a dialect without token-id prompts, or of no one server

# What a client sends on each declared route, with the fields the record keeps (model, prompt,
# sampling, stream), and a server's whole answer to it.
EXAMPLES: dict[str, tuple[Json, Json]] = {
    "openai.chat": (
        {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Paris?"}],
         "tools": [{"type": "function", "function": {"name": "look", "parameters": {}}}],
         "temperature": 0.5, "max_tokens": 8},
        {"id": "chatcmpl-1", "model": "tiny-qwen", "choices": [{"index": 0, "finish_reason":
         "stop", "message": {"role": "assistant", "content": "Yes."}}]},
    ),
    "openai.completions": (
        {"model": "tiny-qwen", "prompt": [785, 6722, 315], "max_tokens": 4, "n": 2},
        {"id": "cmpl-1", "model": "tiny-qwen", "choices": [
            {"index": 0, "text": " Paris", "finish_reason": "stop"},
            {"index": 1, "text": " Rome", "finish_reason": "stop"}]},
    ),
    "vllm.generate": (
        {"model": "tiny-qwen", "token_ids": [785, 6722, 315], "priority": 1,
         "sampling_params": {"max_tokens": 4, "temperature": 0.0}},
        {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": [12095, 13],
         "finish_reason": "stop"}], "prompt_token_ids": [785, 6722, 315]},
    ),
    "sglang.generate": (
        {"input_ids": [785, 6722, 315], "sampling_params": {"max_new_tokens": 4}},
        {"text": " Paris.", "output_ids": [12095, 13],
         "meta_info": {"id": "s-1", "finish_reason": {"type": "stop"}, "prompt_tokens": 3,
                       "completion_tokens": 2}},
    ),
}  # fmt: skip


def test_every_route_capture_parses_is_a_declared_dialect_with_every_piece() -> None:
    assert set(PARSERS) == set(DECLARED)  # a parser per declaration, and no parser undeclared
    assert len({d.name for d in DECLARED}) == len(DECLARED)
    routes = [route for d in DECLARED for route in d.routes]
    assert len(set(routes)) == len(routes) and set(DIALECTS) == set(routes)
    for route, (name, parse) in DIALECTS.items():
        declared = dialect_named(name)
        assert route in declared.routes and PARSERS[declared] is parse
        assert classify("POST", route) is RouteKind.GENERATE
        assert PROMPT_IDS.get(route) == declared.prompt_ids
    for dialect in DECLARED:
        for field in dataclasses.fields(Dialect):
            value = getattr(dialect, field.name)
            if value is None:
                assert field.name in MAY_BE_NONE, f"{dialect.name} lacks {field.name}"
            elif isinstance(value, (str, tuple)):
                assert value, f"{dialect.name}: {field.name} is empty"
        assert dialect.routes and all(r.startswith("/") for r in dialect.routes)
        assert all(isinstance(n, str) and n for n in dataclasses.astuple(dialect.operations))
        assert callable(dialect.request)
    assert set(EXAMPLES) == set(BY_NAME), "every declared dialect has an example here"


def test_every_parser_module_is_found_and_a_stray_one_stops_the_import() -> None:
    """A new dialect's parser needs no list: each module of the package is found, and one that
    names no declared dialect, or a dialect that already has a parser, is refused by name."""
    package = Path(capture_dialects.__file__).parent
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "common"}
    assert {parse.__module__.rsplit(".", 1)[1] for parse in PARSERS.values()} == modules

    def module(name: str, dialect: object) -> ModuleType:
        made = ModuleType(f"trace_proxy.capture.dialects.{name}")
        vars(made).update(DIALECT=dialect, parse=PARSERS[dialects.OPENAI_CHAT])
        return made

    found = capture_dialects._parsers(
        [module("b", dialects.SGLANG_GENERATE), module("a", dialects.OPENAI_CHAT)]
    )
    assert list(found) == [dialects.OPENAI_CHAT, dialects.SGLANG_GENERATE]  # declarations' order
    undeclared = dataclasses.replace(dialects.OPENAI_CHAT, name="lab.chat")
    with pytest.raises(ImportError, match=r"dialects\.lab must name a declared DIALECT"):
        capture_dialects._parsers([module("lab", undeclared)])
    twice = [module("one", dialects.OPENAI_CHAT), module("two", dialects.OPENAI_CHAT)]
    with pytest.raises(ImportError, match=r"dialects\.two: openai\.chat already has a parser"):
        capture_dialects._parsers(twice)


def exchange_of(route: str, request: Json, response: Json) -> Exchange:
    return Exchange(
        method="POST", path=route, query="", request_headers=CIMultiDictProxy(CIMultiDict()),
        path_metadata=[], upstream="http://u", start=1.0, request_body=orjson.dumps(request),
        status=200, response_headers=CIMultiDict({"Content-Type": "application/json"}),
        response_chunks=[orjson.dumps(response)], first_byte=1.5, end=2.0,
    )  # fmt: skip


def stored(calls: list[GenerateCall]) -> Json:
    """A trajectory of these calls as the store holds it."""
    for index, call in enumerate(calls):
        call.index = index
    trajectory = Trajectory(
        id="d" * 32, key=RolloutKey(project="p", experiment="e", step=1), start=1.0, end=2.0,
        status="ok", close_reason="done", calls=calls,
    )  # fmt: skip
    record: Json = orjson.loads(dumps(trajectory))
    return record


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_call_capture_records_is_sent_again_as_it_was_asked(name: str) -> None:
    request, response = EXAMPLES[name]
    declared = BY_NAME[name]
    [route] = declared.routes
    parsed = PARSERS[declared](exchange_of(route, request, response), request)
    assert parsed and all(p.call.dialect == name for p in parsed)
    assert not any(p.call.unparsed for p in parsed)
    [again] = replay_calls(stored([p.call for p in parsed]))
    assert isinstance(again, ReplayCall)
    assert (again.path, again.body, again.stream) == (route, request, False)


def a_call(dialect: str, **fields: Any) -> GenerateCall:
    call = GenerateCall(
        index=0, dialect=dialect, route="/lab/echo", upstream="http://lab:9000", start=1.0,
        end=2.0, model="tiny-qwen", http_status=200, sampling={"max_tokens": 4},
        outputs=[Output(index=0, text="Paris.", finish_reason="stop")],
    )  # fmt: skip
    call.prompt = Prompt(text="The capital of France is")
    for key, value in fields.items():
        setattr(call, key, value)
    return call


def echo_request(sampling: Mapping[str, Any], prompt: Mapping[str, Any]) -> Json | str:
    text = prompt.get("text")
    return {"say": text, "options": dict(sampling)} if isinstance(text, str) else "no text"


# A dialect no part of the proxy has heard of, each of its names its own.
LAB = Dialect(
    name="lab.echo", routes=("/lab/echo",), prompt_ids=None, chat=False, names_model=False,
    encodes_text_prompt=True, provider="lab-server",
    operations=Operations(gen_ai="lab_gen_ai", trackio="lab_trackio", weave="lab_weave"),
    request=echo_request,
)  # fmt: skip


@pytest.fixture
def lab_declared(monkeypatch: pytest.MonkeyPatch) -> Dialect:
    monkeypatch.setitem(dialects.BY_NAME, LAB.name, LAB)  # type: ignore[index]
    return LAB


def test_a_new_declaration_is_all_replay_and_drift_read(
    lab_declared: Dialect, qwen_tokenizer: Any
) -> None:
    record = stored([a_call("lab.echo", model=None), a_call("lab.other")])
    sent, refused = replay_calls(record, model="other-model")
    assert isinstance(sent, ReplayCall) and sent.path == "/lab/echo"
    # Its own body, and no model: the declaration says its requests name none.
    assert sent.body == {"say": "The capital of France is", "options": {"max_tokens": 4}}
    dialects.BY_NAME[LAB.name] = dataclasses.replace(LAB, names_model=True)  # type: ignore[index]
    [sent, _] = replay_calls(record, model="other-model")
    assert isinstance(sent, ReplayCall) and sent.body["model"] == "other-model"
    assert refused == NotReplayable(1, "the request was not understood when recorded "
                                       "(dialect 'lab.other')")  # fmt: skip

    # Drift encodes a text prompt as the server would where the declaration says it does.
    codec = codec_for(qwen_tokenizer)
    calls = [a_call("lab.echo"), a_call("lab.other")]
    known = known_prompt_ids(calls, [None, None], [codec, codec])
    assert known == [codec.encode_prompt("The capital of France is"), None]


def test_a_new_declaration_is_all_each_trace_backend_reads(lab_declared: Dialect) -> None:
    trajectory = Trajectory(
        id="e" * 32, key=RolloutKey(project="p", experiment="e", step=1), start=1.0, end=2.0,
        status="ok", close_reason="done", calls=[a_call("lab.echo")],
    )  # fmt: skip
    view = trajectory_spans(orjson.loads(dumps(trajectory)))
    [call] = view.calls
    assert call.declared is LAB

    # OpenTelemetry: its operation and provider, and the provider told of its upstream.
    providers = otlp_conventions.providers_of(view.calls)
    assert providers == {"http://lab:9000": "lab-server"}
    attributes = otlp_conventions.CallView(call, providers, "conv", None).attributes()
    assert attributes["gen_ai.operation.name"] == "lab_gen_ai"
    assert attributes["gen_ai.provider.name"] == "lab-server"
    root = otlp_conventions.root_attributes(view, "conv", [])
    assert root["gen_ai.agent.name"] == ROOT_NAME

    # trackio: the generation span's name.
    root_span, generation = trackio.spans_of(view)
    assert root_span["name"] == ROOT_NAME
    assert generation["name"] == "lab_trackio tiny-qwen"

    # MLflow: not chat, so its answer is a text choice, not a message.
    trace = mlflow_traces.render(trajectory, None)
    assert trace.info_tags["mlflow.traceName"] == ROOT_NAME
    llm = next(span for span in trace.spans if not span.root)
    assert llm.outputs["choices"] == [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]
    chat = dataclasses.replace(LAB, chat=True)
    dialects.BY_NAME[LAB.name] = chat  # type: ignore[index]
    llm = next(span for span in mlflow_traces.render(trajectory, None).spans if not span.root)
    assert llm.outputs["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}


async def test_a_new_declaration_names_its_weave_op(lab_declared: Dialect) -> None:
    pytest.importorskip("weave")
    from fakes.weave_server import FakeWeaveServer

    from trace_proxy.exporters.backends.weave import WeaveExporter, call_id

    trajectory = Trajectory(
        id="f" * 32, key=RolloutKey(project="p", experiment="e", step=1), start=1.0, end=2.0,
        status="ok", close_reason="done", calls=[a_call("lab.echo")],
    )  # fmt: skip
    fake = FakeWeaveServer()
    async with fake.serve() as url:
        exporter = WeaveExporter("ent", "proj", server_url=url, api_key="k" * 40)
        try:
            await asyncio.wait_for(asyncio.to_thread(exporter.export, [trajectory]), 30)
        finally:
            await asyncio.wait_for(asyncio.to_thread(exporter.close), 30)
    root = fake.stored[call_id(trajectory.id, "root")]
    child = fake.stored[call_id(trajectory.id, "call/0")]
    assert root["op_name"] == f"weave:///ent/proj/op/{ROOT_NAME}:{fake.objects[ROOT_NAME]}"
    assert child["op_name"] == f"weave:///ent/proj/op/lab_weave:{fake.objects['lab_weave']}"
    assert child["display_name"] == "lab_weave tiny-qwen"


def test_a_call_of_no_declared_dialect_is_named_as_a_generate_and_never_sent() -> None:
    for name in (None, 7, "", "lab.other"):
        assert dialect_named(name) is UNDECLARED
    assert UNDECLARED.request is None and UNDECLARED.provider is None
    assert UNDECLARED.operations == Operations("text_completion", "generate", "generate")
