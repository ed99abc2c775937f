"""Fuzzing the capture side with hostile input: whatever a client or an upstream sends, no
exception escapes, no request fails, and every call is recorded (as unparsed, with a reason,
where it cannot be parsed).

Bodies are arbitrary bytes, or the wire formats of each dialect (the examples of the inference
API reference) with any field replaced by a value of any type, nested deeper than a record can
hold, or cut; event streams are cut anywhere, with garbage lines, CR/LF variants and huge
lines; key metadata (X-Rollout-* headers, baggage, path prefix, body mappings) is arbitrary
text, including the lone surrogates aiohttp makes of bytes that are not UTF-8. Unit-level
tests drive the real `CaptureStage.process`; one test sends fuzzed requests through a running
proxy. Runs are bounded to stay within seconds, and derandomized on CI (the CI variable set);
FUZZ_EXAMPLES and FUZZ_E2E_EXAMPLES raise the numbers of examples for a longer search.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from support.proxies import running_proxy, scripted_upstream, trajectories

from trace_proxy.capture.control import EVENTS
from trace_proxy.capture.dialects import DIALECTS
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver, split_rollout_prefix
from trace_proxy.capture.sse import iter_data
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.config import Settings
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.keys import HEADER_NAMES, KeyHints, parse_mapping
from trace_proxy.trajectories.record import GenerateCall, Record, StepEvent, Trajectory, dumps
from trace_proxy.trajectories.sampler import sample_hash, sampler_of

CI = bool(os.environ.get("CI"))
FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=CI,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
Json = Any

# --- wire formats (the inference API reference's examples): the seeds of hostile bodies --------

# fmt: off
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
LOGPROBS_CHAT = {"content": [{"token": "<tool_call>", "logprob": -0.01, "bytes": [60, 116],
                              "top_logprobs": [{"token": "<tool_call>", "logprob": -0.01}]}]}
LOGPROBS_COMPLETIONS = {"text_offset": [0, 6], "token_logprobs": [-0.0123, -0.51],
                        "tokens": [" Paris", "."], "top_logprobs": [{" Paris": -0.0123}]}
TOOL_CALLS = [{"id": "chatcmpl-tool-9f3e", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
USAGE = {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
VERSIONS = [{"version": "v3", "start": 0, "end": 2}]
SGLANG_META = {"id": "rollout-42-0", "finish_reason": {"type": "length", "length": 2},
               "prompt_tokens": 5, "weight_version": "default", "completion_tokens": 2,
               "cached_tokens": 0, "output_token_logprobs": [[-0.0123, 12095, None]],
               "output_top_logprobs": [[[-0.0123, 12095, None]]]}

REQUESTS: dict[str, list[Json]] = {
    "/v1/chat/completions": [
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
         "tools": TOOLS, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
         "n": 2, "stream": False, "rid": "t-1"},
        {"model": "m", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
            {"role": "tool", "tool_call_id": "chatcmpl-tool-9f3e", "content": '{"temp_c":18}'}],
         "stream": True, "stream_options": {"include_usage": True}},
    ],
    "/v1/completions": [
        {"model": "m", "prompt": [785, 6722, 315], "max_tokens": 2, "logprobs": 1, "n": 2,
         "return_token_ids": True, "request_id": "t-2"},
        {"model": "m", "prompt": ["a", [1, 2], "b"], "stream": True},
        {"model": "m", "prompt": "The capital of France is", "echo": True},
    ],
    "/inference/v1/generate": [
        {"token_ids": [785, 6722, 315], "sampling_params": {"max_tokens": 2, "logprobs": 1},
         "return_token_ids": True, "stream": False},
    ],
    "/generate": [
        {"input_ids": [785, 6722, 315], "sampling_params": {"max_new_tokens": 2, "n": 2},
         "return_logprob": True, "rid": "rollout-42-0"},
        {"input_ids": [[1, 2], [3, 4]], "sampling_params": [{"n": 1}, {"n": 2}],
         "rid": ["a-0", "b-0"], "stream": True},
        {"text": ["a", "b"], "sampling_params": {"temperature": 0}},
    ],
}
RESPONSES: dict[str, list[Json]] = {
    "/v1/chat/completions": [
        {"id": "chatcmpl-5d2a", "model": "m", "usage": USAGE, "prompt_token_ids": [151644, 872],
         "choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                               "tool_calls": TOOL_CALLS, "reasoning": None},
                      "logprobs": LOGPROBS_CHAT, "finish_reason": "tool_calls",
                      "stop_reason": None, "token_ids": [151657, 198],
                      "weight_versions": VERSIONS, "prompt_token_ids": [1, 2],
                      "response_token_ids": [3]}]},
    ],
    "/v1/completions": [
        {"id": "cmpl-8c1f0e", "model": "m", "usage": USAGE,
         "choices": [{"index": 0, "text": " Paris.", "logprobs": LOGPROBS_COMPLETIONS,
                      "finish_reason": "length", "stop_reason": None, "token_ids": [12095, 13],
                      "prompt_token_ids": [785, 6722, 315], "weight_versions": VERSIONS},
                     {"index": 1, "text": "x", "matched_stop": 2}]},
    ],
    "/inference/v1/generate": [
        {"request_id": "generate-tokens-ab12", "model": "m", "usage": USAGE,
         "prompt_token_ids": [785, 6722, 315],
         "choices": [{"index": 0, "finish_reason": "length", "token_ids": [12095, 13],
                      "weight_versions": ["v1"],
                      "logprobs": {"content": [{"token_id": 12095, "logprob": -0.0123}]}}]},
    ],
    "/generate": [
        {"text": " Paris.", "output_ids": [12095, 13], "meta_info": SGLANG_META},
        [{"text": "a", "output_ids": [1], "meta_info": SGLANG_META},
         {"text": "b", "output_ids": [2], "meta_info": {**SGLANG_META, "id": "b-0"}}],
        {"text": ["The capital of France is Paris."],  # vLLM's legacy /generate
         "meta_info": {"finish_reason": {"type": "abort"}}},
    ],
}
EVENTS_OF: dict[str, list[Json]] = {
    "/v1/chat/completions": [
        {"id": "c", "model": "m", "prompt_token_ids": [1, 2],
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi", "reasoning": "r"},
                                 "token_ids": [5], "logprobs": LOGPROBS_CHAT}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "t", "type": "function",
             "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]},
            "finish_reason": "tool_calls", "stop_reason": 7, "weight_versions": VERSIONS}]},
        {"id": "c", "choices": [], "usage": USAGE},
        {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}},
    ],
    "/v1/completions": [
        {"id": "c", "model": "m", "choices": [{"index": 0, "text": " Paris",
                                               "prompt_token_ids": [1, 2], "token_ids": [9]}]},
        {"id": "c", "choices": [{"index": 1, "text": ".", "finish_reason": "length",
                                 "logprobs": LOGPROBS_COMPLETIONS, "weight_versions": VERSIONS}]},
        {"id": "c", "choices": [], "usage": USAGE},
        {"error": "boom"},
    ],
    "/inference/v1/generate": [
        {"request_id": "r", "model": "m", "prompt_token_ids": [1, 2],
         "choices": [{"index": 0, "token_ids": [9]}]},
        {"request_id": "r", "usage": USAGE,
         "choices": [{"index": 0, "token_ids": [10], "finish_reason": "length"}]},
    ],
    "/generate": [
        {"text": " Paris", "output_ids": [12095],
         "meta_info": {**SGLANG_META, "completion_tokens": 1}},
        {"text": " Paris.", "output_ids": [12095, 13], "meta_info": SGLANG_META, "index": 1},
        {"text": ".", "output_ids": [13],
         "meta_info": {"id": "x", "completion_tokens": 9, "output_token_logprobs": [[-1, 13]]}},
        {"error": {"message": "abort"}},
    ],
}
CONTROL_BODIES: list[Json] = [
    {"weight_version": "v3"}, {"new_version": 7}, {"update_info": {}},
    {"names": ["w"], "dtypes": ["bf16"], "shapes": [[4096, 4096]], "flush_cache": True},
]
# fmt: on
GENERATE_ROUTES = sorted(DIALECTS)
DEEP = "__deep__"  # a placeholder JSON text: replaced by nesting deeper than a record can hold
HUGE = b"<huge line>"  # replaced by 300 kB when the test runs (and not in reports)


# --- strategies --------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", "0", "-1", "nan", "token_id:5", "token_id:x", "[DONE]", DEEP]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def hostile(draw: st.DrawFn, value: Json) -> Json:
    """`value` with any field replaced by a value of any type, dropped, or left as it is."""
    choice = draw(st.integers(0, 11))
    if choice == 0:
        return draw(json_values)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if draw(st.integers(0, 9)) == 0:
                continue  # a field missing
            out[key] = draw(hostile(item))
        return out
    if isinstance(value, list):
        items = [draw(hostile(item)) for item in value]
        if items and draw(st.integers(0, 9)) == 0:
            items.append(items[0])  # a list longer than the request's
        return items
    return value


def encode(value: Json) -> bytes:
    """JSON text, with the placeholder made into nesting deeper than orjson writes (255)."""
    text = orjson.dumps(value)
    return text.replace(b'"' + DEEP.encode() + b'"', b"[" * 300 + b"{}" + b"]" * 300)


def network_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Text as aiohttp decodes a header or a path: bytes that are not UTF-8 become lone
    surrogates (`surrogateescape`)."""
    return st.one_of(
        st.text(max_size=max_size),
        st.binary(max_size=max_size).map(lambda b: b.decode("utf-8", "surrogateescape")),
        st.sampled_from(["1", "0", "true", "no", "99999999999999999999999999", "٣", "²", "-1"]),
    )


@st.composite
def key_metadata(draw: st.DrawFn) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Headers (X-Rollout-*, baggage, a mapped header) and path prefix items."""
    headers = [
        (name, draw(network_text()))
        for name in draw(st.lists(st.sampled_from(sorted(HEADER_NAMES.values())), max_size=4))
    ]
    for _ in range(draw(st.integers(0, 2))):
        members = draw(st.lists(st.tuples(
            st.sampled_from(["rollout.step", "rollout.n", "rollout.trajectory_id",
                             "rollout.bogus", "other"]) | network_text(10),
            network_text(),
        ), max_size=3))  # fmt: skip
        separator = draw(st.sampled_from([",", ";", " , "]))
        headers.append(("baggage", separator.join(f"{k}={v}" for k, v in members)))
    if draw(st.booleans()):
        headers.append(("X-Session-ID", draw(network_text())))
    path = draw(st.lists(st.tuples(
        st.sampled_from(["step", "sample_index", "n", "validate", "experiment", "x"])
        | network_text(10),
        network_text(),
    ), max_size=3))  # fmt: skip
    return headers, path


@st.composite
def event_stream(draw: st.DrawFn, route: str) -> bytes:
    """The route's events, hostile, among comments and garbage, in any line-ending style,
    possibly cut anywhere, possibly with a huge line."""
    lines: list[bytes] = []
    for event in draw(st.lists(st.sampled_from(EVENTS_OF[route]), max_size=6)):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            lines.append(b": keep-alive")
        elif kind == 1:
            lines.append(draw(st.binary(max_size=30)))
        elif kind == 2:
            lines.append(b"data:" + encode(draw(hostile(event))))  # no space after the colon
        else:
            lines.append(b"data: " + encode(draw(hostile(event))))
    if draw(st.booleans()):
        lines.append(b"data: [DONE]")
    if draw(st.integers(0, 9)) == 0:
        lines.insert(draw(st.integers(0, len(lines))), b"data: " + HUGE)
    newline = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    body = b"".join(line + newline + newline for line in lines)
    if body and draw(st.booleans()):
        body = body[: draw(st.integers(0, len(body)))]
    return body


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[Exchange, Json]:
    """An exchange on any generate route with a hostile body (or arbitrary bytes), a hostile
    answer (JSON, stream or bytes), any status, and fuzzed key metadata. Also the request
    as decoded (None when it is not JSON)."""
    route = draw(st.sampled_from(GENERATE_ROUTES))
    if draw(st.integers(0, 5)) == 0:
        request_body = draw(st.binary(max_size=200))
    else:
        request_body = encode(draw(hostile(draw(st.sampled_from(REQUESTS[route])))))
    stream = draw(st.integers(0, 2)) == 0
    if stream:
        response_body = draw(event_stream(route))
        content_type = "text/event-stream"
    elif draw(st.integers(0, 5)) == 0:
        response_body = draw(st.binary(max_size=200))
        content_type = draw(st.sampled_from(["application/json", "text/plain"]))
    else:
        response_body = encode(draw(hostile(draw(st.sampled_from(RESPONSES[route])))))
        content_type = "application/json"
    headers, path_items = draw(key_metadata())
    cut = draw(st.integers(0, len(response_body)))
    exchange = Exchange(
        method=draw(st.sampled_from(["POST", "PUT"])) if route == "/generate" else "POST",
        path=route,
        query="",
        request_headers=CIMultiDictProxy(CIMultiDict(headers)),
        path_metadata=path_items,
        upstream="http://u",
        start=draw(st.floats(0, 10)),
        request_body=request_body,
        status=draw(st.sampled_from([200, 200, 200, 400, 500, None])),
        response_headers=CIMultiDict({"Content-Type": content_type}),
        response_chunks=[c for c in (response_body[:cut], response_body[cut:]) if c],
        end=draw(st.none() | st.floats(10, 20)),
        error=draw(st.none() | st.just("upstream reset mid-response: gone")),
    )
    return exchange, decoded(request_body)


def decoded(body: bytes) -> Json:
    """The request as the capture stage sees it (None when it is not JSON)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


# --- the harness --------------------------------------------------------------------------------


class Recording(Assembler):
    """The real assembler, noting every call, event and tool call that reaches it."""

    def __init__(self, emit: Callable[[Record], None], **options: Any) -> None:
        super().__init__(emit, **options)
        self.calls: list[GenerateCall] = []
        self.events: list[StepEvent] = []
        self.tools = 0

    def add_call(self, hints: KeyHints, call: GenerateCall, *args: Any, **kw: Any) -> None:
        self.calls.append(call)
        super().add_call(hints, call, *args, **kw)

    def add_event(self, event: StepEvent) -> None:
        self.events.append(event)
        super().add_event(event)

    def add_tool(self, hints: KeyHints, tool: Any) -> None:
        self.tools += 1
        super().add_tool(hints, tool)


RULES = [
    "header:X-Session-ID=trajectory_id",
    r"body:rid=/^(?P<trajectory_id>.+)-(?P<rollout_n>\d+)$/",
    "body:request_id=trajectory_id",
]


def stage_and_assembler(sample_rate: float | None) -> tuple[CaptureStage, Recording, list[Record]]:
    records: list[Record] = []
    settings = Settings(sample_rate=sample_rate)
    assembler = Recording(
        records.append,
        project="p",
        experiment="e",
        idle_timeout=300,
        inference=TrafficInference(),
        gate=SamplingGate(sampler_of(settings), records.append),
    )
    resolver = MetadataResolver([parse_mapping(rule) for rule in RULES])
    stage = CaptureStage(resolver, assembler, Metrics(), project="p", experiment="e",
                         queue_size=10, idle_check_interval=60)  # fmt: skip
    return stage, assembler, records


def expected_calls(route: str, request: Json) -> int:
    """The documented number of calls for a request: one, or one per prompt of a batch."""
    if not isinstance(request, dict):
        return 1
    if route == "/v1/completions":
        prompt = request.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and not _ids(prompt)
            and all(isinstance(i, str) or _ids(i) for i in prompt)
        ):
            return len(prompt)
    if route == "/generate":
        ids, text = request.get("input_ids"), request.get("text")
        if ids is not None:
            if isinstance(ids, list) and ids and not _ids(ids) and all(_ids(i) for i in ids):
                return len(ids)
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return len(text)
    return 1


def _ids(value: Json) -> bool:
    """Token ids as the parsers take them (`as_int_list`: integers, never JSON's booleans)."""
    return isinstance(value, list) and all(type(i) is int for i in value)


def assert_recordable(records: list[Record]) -> None:
    """Every record can be written: the spool's encoding never fails on what came in."""
    for record in records:
        assert orjson.loads(dumps(record))


@FUZZ
@given(exchanges(), st.sampled_from([None, 0.5]))
def test_any_exchange_on_a_generate_route_is_recorded(
    item: tuple[Exchange, Json], sample_rate: float | None
) -> None:
    """The documented number of calls reaches the assembler, none of them a parser error,
    one that could not be read is unparsed, and every record built can be written."""
    exchange, request = item
    exchange.response_chunks = [c.replace(HUGE, b"x" * 300_000) for c in exchange.response_chunks]
    stage, assembler, records = stage_and_assembler(sample_rate)
    if not stage.admit(exchange):
        return  # the headers named a sample the sampler drops: nothing is parsed
    stage.process(exchange)
    route = exchange.path
    assert len(assembler.calls) == expected_calls(route, request)
    for call in assembler.calls:
        assert call.dialect == DIALECTS[route][0]
        assert not (call.unparsed or "").startswith("parser error"), call.unparsed
        if not isinstance(request, dict):
            assert call.unparsed, "a body that is not a JSON object is recorded as unparsed"
    assembler.close_all()
    assert_recordable(records)
    built = [c for r in records if isinstance(r, Trajectory) for c in r.calls]
    resumed = sum(len(c.segments) - 1 for c in built if c.segments)  # merged into one call
    if sample_rate is None:  # else the sampler may drop some: it counts them
        assert len(built) + resumed == len(assembler.calls)


@FUZZ
@given(
    st.sampled_from(sorted(EVENTS)),
    st.one_of(
        st.binary(max_size=100), st.sampled_from(CONTROL_BODIES).flatmap(hostile).map(encode)
    ),
    st.sampled_from([200, 400, None]),
    key_metadata(),
)
def test_any_control_exchange_is_a_step_event(
    path: str, body: bytes, status: int | None, metadata: Any
) -> None:
    """Whatever its body, a weight update or a pause is one step event, and recordable."""
    headers, path_items = metadata
    stage, assembler, records = stage_and_assembler(None)
    stage.process(Exchange(
        method="POST", path=path, query="", request_headers=CIMultiDictProxy(CIMultiDict(headers)),
        path_metadata=path_items, upstream="http://u", start=1.0, request_body=body,
        status=status, response_chunks=[b'{"error": "x"}'],
    ))  # fmt: skip
    assert len(assembler.events) == 1
    assembler.close_all()
    assert_recordable(records)


@FUZZ
@given(network_text(60), st.binary(max_size=300), st.binary(max_size=300), key_metadata())
def test_any_tool_server_exchange_is_a_tool_call(
    path: str, request: bytes, response: bytes, metadata: Any
) -> None:
    """Any path and bodies of a tool server (tool routes forward every path) make a span."""
    headers, path_items = metadata
    stage, assembler, records = stage_and_assembler(None)
    stage.process(Exchange(
        method="POST", path="/" + path, query="",
        request_headers=CIMultiDictProxy(CIMultiDict(headers)), path_metadata=path_items,
        upstream="http://tools", start=1.0, request_body=request, status=500,
        response_chunks=[response], tool_route="search",
    ))  # fmt: skip
    assert assembler.tools == 1
    assembler.close_all()
    assert_recordable(records)


# --- the parsers one by one ---------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=2000))
def test_the_event_stream_splitter_takes_any_bytes(body: bytes) -> None:
    """Whatever an upstream streams, the splitter gives payloads (the parsers judge them)."""
    for payload in iter_data(body):
        assert isinstance(payload, bytes)


@FUZZ
@given(
    st.lists(st.binary(max_size=50).filter(lambda b: b"\r" not in b and b"\n" not in b),
             max_size=5),
    st.sampled_from([b"\r\n", b"\r"]),
)  # fmt: skip
def test_every_line_ending_of_the_event_stream_standard_splits_alike(
    payloads: list[bytes], newline: bytes
) -> None:
    """CRLF, LF and CR each end a line (the SSE standard); vLLM and SGLang write LF."""
    stream = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    assert list(iter_data(stream.replace(b"\n", newline))) == list(iter_data(stream))


@FUZZ
@given(key_metadata(), st.one_of(st.none(), json_values))
def test_key_metadata_of_any_text_gives_values_a_record_and_the_sampler_can_use(
    metadata: Any, rid: Json
) -> None:
    """Malformed values fall through as annotations; what is kept can be hashed and written."""
    headers, path_items = metadata
    resolver = MetadataResolver([parse_mapping(rule) for rule in RULES])
    hints = resolver.resolve(CIMultiDictProxy(CIMultiDict(headers)), path_items, {"rid": rid})
    orjson.dumps(hints.values)
    orjson.dumps(hints.annotations)
    values = hints.values
    sample_hash(0, values.get("experiment", "e"), values.get("step"), bool(values.get("validate")),
                values.get("sample_index"))  # fmt: skip


@FUZZ
@given(network_text(80))
def test_the_path_prefix_splitter_takes_any_path(tail: str) -> None:
    """Any path under the prefix gives a target to forward and text items."""
    target, items = split_rollout_prefix("/rollout/" + tail)
    assert target.startswith("/")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in items)


# --- through a running proxy --------------------------------------------------------------------


def answer_for(body: bytes) -> tuple[bytes, str]:
    """What the scripted upstream answers a body: deterministic, and hostile itself."""
    digest = sum(body) % 7
    if digest == 0:
        return b"data: {\"choices\": [{\"index\": \"x\"}]}\r\r" + body[:50] + b"\n\n", (
            "text/event-stream")  # fmt: skip
    if digest == 1:
        return body[::-1], "application/json"
    return orjson.dumps({"choices": [{"index": digest, "text": body[:20].hex()}],
                         "usage": {"prompt_tokens": len(body)}}), "application/json"  # fmt: skip


async def echo_upstream(request: web.Request) -> web.StreamResponse:
    body, content_type = answer_for(await request.read())
    return web.Response(body=body, headers={"Content-Type": content_type})


@pytest.fixture(scope="module")
async def fuzz_proxy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One proxy (with its capture and export processes) for every example. It keeps every
    sample, but by a rate: the sampler hashes each call's key on both sides of the socket."""
    output = tmp_path_factory.mktemp("fuzz-store")
    async with (
        scripted_upstream(echo_upstream) as up,
        running_proxy([up], output, sample_rate=1.0) as (service, proxy),
    ):
        yield service, proxy, output


sent_ids = iter(range(1 << 30))


def field_bytes(text: str) -> bytes:
    """What a client may put in a header value or a path: the text's bytes (a lone surrogate
    back to the byte it stood for), without the control characters HTTP forbids there."""
    raw = text.encode("utf-8", "surrogateescape")
    return bytes(b for b in raw if (b >= 0x20 and b != 0x7F) or b == 0x09)


async def raw_post(url: str, target: bytes, fields: list[tuple[bytes, bytes]], body: bytes
                   ) -> tuple[bytes, bytes]:  # fmt: skip
    """POST with bytes as they are (aiohttp's client would encode header text as UTF-8):
    the status line and the body of the answer."""
    host, _, port = url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    status, _, rest = answer.partition(b"\r\n")
    return status, rest.partition(b"\r\n\r\n")[2]


E2E = settings(
    max_examples=int(os.environ.get("FUZZ_E2E_EXAMPLES", "30")),
    deadline=None,
    derandomize=CI,
    suppress_health_check=[HealthCheck.too_slow],
)


@E2E
@given(data=st.data())
async def test_fuzzed_requests_through_the_proxy_are_answered_and_recorded(
    fuzz_proxy: Any, data: st.DataObject
) -> None:
    """Each request gets the upstream's answer byte for byte, and its calls are in the
    store (the capture and export processes in between, as deployed)."""
    service, proxy, output = fuzz_proxy
    route = data.draw(st.sampled_from(GENERATE_ROUTES))
    if data.draw(st.booleans()):
        body = data.draw(st.binary(max_size=300))
    else:
        body = encode(data.draw(hostile(data.draw(st.sampled_from(REQUESTS[route])))))
    request = decoded(body)
    headers, path_items = data.draw(key_metadata())
    trajectory = f"fuzz-{next(sent_ids)}"
    # The first of a header wins: the test's own name the trajectory and close it.
    fields = [(b"X-Rollout-Trajectory-Id", trajectory.encode()), (b"X-Rollout-Done", b"1")]
    fields += [(name.encode(), field_bytes(value)) for name, value in headers]
    prefix = b"".join(b"/" + _quote(key) + b"=" + _quote(value) for key, value in path_items)
    target = (b"/rollout" + prefix if prefix else b"") + route.encode()
    status, answer = await raw_post(proxy, target, fields, body)
    assert status == b"HTTP/1.1 200 OK"
    assert answer == answer_for(body)[0]
    await service.flush()
    # A batch's calls each carry the done flag: each closes the trajectory (a part each).
    recorded = [t for t in trajectories(output) if t["key"]["trajectory_id"] == trajectory]
    assert sum(len(t["calls"]) for t in recorded) == expected_calls(route, request)


def _quote(text: str) -> bytes:
    """A path segment, percent-encoded (aiohttp refuses other bytes in a path): bytes that are
    not UTF-8 arrive as U+FFFD."""
    return quote(text.encode("utf-8", "surrogateescape"), safe="").encode()
