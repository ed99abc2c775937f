"""The fakes and the proxy's parsers checked against the servers' own wire definitions.

SGLang has no CPU build, so its fake cannot be compared with a running server; its definitions
can be imported without a GPU (tests/real/conformance/validate.py, in the `sglang-protocol`
venv: sglang 0.5.23 installed without its runtime). vLLM's are imported from the real vLLM CPU
venv. Every request the tests send and every document the fakes answer (whole bodies, every
streamed chunk including the usage chunk, error bodies) is validated by the definition of its
route, strictly: a key no definition declares is a failure.

SGLang's `/generate` answer is a dict the tokenizer manager builds, not a model: it is decoded
by SGLang's generated JSON contract (`sglang.api.v1.GenerateResponse`, which types `meta_info`,
its `finish_reason` object and `[logprob, token_id, text]` entries), and every `meta_info` key
must be one the manager's source sets (read from the installed `tokenizer_manager.py` and the
time-stats and weight-version helpers it calls). Requests go through the server's schema gate
(`generate_contract_error`) and must only use fields of `GenerateReqInput`.

Then the other way round: documents built BY the definitions from values chosen here are fed to
the proxy's parsers, which must find every value where the definitions put it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from fakes import FakeSGLang, FakeVLLM, StartFake
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.dialects import DIALECTS
from trace_proxy.capture.exchange import Exchange
from trace_proxy.integrations.verl.mapping import ServerLimits, sglang_request, vllm_request

VALIDATE = Path(__file__).resolve().parent / "conformance" / "validate.py"
MODEL = "tiny-qwen"
PROMPT_IDS = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SGLANG_LIMITS = ServerLimits("sglang", prompt_length=512, response_length=16, max_model_len=2048)
VLLM_LIMITS = ServerLimits("vllm", prompt_length=512, response_length=16, max_model_len=2048)
Json = Any
Document = dict[str, Any]

# route -> (request kind, response kind, chunk kind)
SGLANG_KINDS = {
    "/generate": ("generate.request", "generate.response", "generate.response"),
    "/v1/completions": ("completion.request", "completion.response", "completion.chunk"),
    "/v1/chat/completions": ("chat.request", "chat.response", "chat.chunk"),
}
VLLM_KINDS = {
    "/inference/v1/generate": ("generate.request", "generate.response", "generate.chunk"),
    "/v1/completions": ("completion.request", "completion.response", "completion.chunk"),
    "/v1/chat/completions": ("chat.request", "chat.response", "chat.chunk"),
}


def _sglang_traffic() -> list[tuple[str, Json]]:
    """What SGLang clients send: verl's mapping, AReaL/slime-style ids, text batches, n > 1,
    logprobs with top-k, streams; and the OpenAI routes with token ids, tools, usage."""
    params = {"temperature": 0.0, "max_new_tokens": 6}
    verl = sglang_request(PROMPT_IDS, {"logprobs": True}, SGLANG_LIMITS, request_id="v1")
    return [
        ("/generate", verl),
        ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": params,
                       "return_logprob": True, "top_logprobs_num": 2,
                       "return_text_in_logprobs": True, "return_prompt_token_ids": True}),
        ("/generate", {"text": ["Hello", "Say hi"], "sampling_params": {**params, "n": 2}}),
        ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": params, "stream": True,
                       "return_logprob": True, "logprob_start_len": -1}),
        ("/generate", {"input_ids": [PROMPT_IDS, PROMPT_IDS[:5]], "stream": True,
                       "sampling_params": params, "rid": ["a", "b"]}),
        ("/generate", {"sampling_params": params, "stream": True}),  # no prompt: streamed error
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 5,
                             "temperature": 0, "return_token_ids": True}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True,
                             "stream_options": {"include_usage": True},
                             "return_token_ids": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 40, "return_token_ids": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 40, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True,
                                  "return_token_ids": True}),  # refused: 400 error body
        *_sglang_refusals(),
    ]  # fmt: skip


def _sglang_refusals() -> list[tuple[str, Json]]:
    """What SGLang refuses, on a fake whose context is SGLANG_LIMITS' (2,048 tokens): a prompt
    the context cannot hold (400), one within the scheduler's reserve (400, or streamed: an
    abort carrying its status, an error event), an empty batch (`[]`), the OpenAI routes'
    validation (400 `ErrorResponse`)."""
    full = list(range(1, SGLANG_LIMITS.max_model_len + 1))
    near = full[:-4]  # passes the manager, within the scheduler's 6-token reserve
    long_chat = [{"role": "user", "content": "word " * SGLANG_LIMITS.max_model_len}]
    usage = {"stream_options": {"include_usage": True}}
    return [
        ("/generate", {"input_ids": full, "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": near}),
        ("/generate", {"input_ids": [near, PROMPT_IDS], "stream": True, "rid": ["n", "p"],
                       "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": [], "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"model": MODEL, "prompt": ""}),
        ("/v1/completions", {"model": MODEL, "prompt": full}),
        ("/v1/completions", {"model": MODEL, "prompt": near, "max_tokens": 1, "stream": True,
                             **usage}),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/chat/completions", {"model": MODEL, "messages": long_chat, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                  "tool_choice": {"type": "function",
                                                  "function": {"name": "get_time"}}}),
    ]  # fmt: skip


def _vllm_traffic() -> list[tuple[str, Json]]:
    """What vLLM clients send: verl's mapping, skyrl's token-in/out route, OpenAI clients."""
    sampling = {"temperature": 0.0, "max_tokens": 6, "logprobs": 1}
    verl = vllm_request(PROMPT_IDS, {"logprobs": True}, VLLM_LIMITS, request_id="v")
    return [
        ("/v1/completions", verl),
        ("/v1/completions", {"model": MODEL, "prompt": [PROMPT_IDS, PROMPT_IDS[:4]],
                             "max_tokens": 5, "n": 2, "logprobs": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True,
                             "stream_options": {"include_usage": True},
                             "return_token_ids": True}),
        ("/v1/completions", {"model": MODEL, "max_tokens": 5}),  # no prompt: 400
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 40, "logprobs": True, "top_logprobs": 2,
                                  "return_token_ids": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 40, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/inference/v1/generate", {"model": MODEL, "token_ids": PROMPT_IDS,
                                    "sampling_params": sampling}),
        ("/inference/v1/generate", {"model": MODEL, "token_ids": PROMPT_IDS, "stream": True,
                                    "sampling_params": sampling,
                                    "stream_options": {"include_usage": True}}),
    ]  # fmt: skip


def _events(body: bytes) -> list[Json]:
    return [
        orjson.loads(block[6:])
        for block in body.split(b"\n\n")
        if block.startswith(b"data: ") and block[6:] != b"[DONE]"
    ]


async def _documents(
    url: str, traffic: list[tuple[str, Json]], kinds: dict[str, tuple[str, str, str]]
) -> list[Document]:
    """Each request and every document of its answer, labelled, with the kind to check."""
    documents: list[Document] = []
    async with aiohttp.ClientSession() as session:
        for n, (path, body) in enumerate(traffic):
            request_kind, response_kind, chunk_kind = kinds[path]
            label = f"{n} {path}"
            if path != "/v1/completions" or "prompt" in body:  # else invalid on purpose
                documents.append({"label": f"{label} request", "kind": request_kind, "body": body})
            async with session.post(url + path, json=body) as response:
                raw = await response.read()
                status, streamed = response.status, response.content_type == "text/event-stream"
            if status >= 400:  # `/generate`'s 400 is `{"error": ErrorBody}`, as its stream's
                kind = "generate.stream_error" if path == "/generate" else "openai.error"
                documents.append({"label": f"{label} error", "kind": kind,
                                  "body": orjson.loads(raw)})  # fmt: skip
            elif streamed:
                for k, event in enumerate(_events(raw)):
                    kind = chunk_kind
                    if "error" in event and path == "/generate":
                        kind = "generate.stream_error"
                    elif "error" in event:  # `{"error": ErrorResponse}`, nothing beside it
                        kind, event = "openai.error", event["error"] if len(event) == 1 else event
                    documents.append({"label": f"{label} chunk {k}", "kind": kind, "body": event})
            else:
                documents.append({"label": f"{label} response", "kind": response_kind,
                                  "body": orjson.loads(raw)})  # fmt: skip
    return documents


async def _validate(python: Path, dialect: str, work: Json, tmp_path: Path) -> Json:
    source, target = tmp_path / f"{dialect}-in.json", tmp_path / f"{dialect}-out.json"
    source.write_text(json.dumps(work))
    process = await asyncio.create_subprocess_exec(
        str(python), str(VALIDATE), dialect, str(source), str(target),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, output.decode(errors="replace")[-4000:]
    result: Json = json.loads(target.read_text())
    return result


# Fields the fake sends as vLLM 0.33.0 does that the CPU build's 0.32.0 models lack (each
# checked in 0.33.0's `vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`).
ADDED_IN_VLLM_0_33 = {
    ("CompletionResponseChoice", "weight_versions"),
    ("CompletionResponseStreamChoice", "weight_versions"),
    ("CompletionStreamResponse", "kv_transfer_params"),
    ("ChatCompletionResponseChoice", "weight_versions"),
    ("ChatCompletionResponseStreamChoice", "weight_versions"),
    ("ChatCompletionStreamResponse", "kv_transfer_params"),
}


def _newer(problem: str) -> bool:
    path, _, model = problem.partition(": not declared by ")
    return (model, path.rsplit(".", 1)[-1]) in ADDED_IN_VLLM_0_33


def _failures(
    result: Json, allowed: Callable[[str], bool] = lambda problem: False
) -> dict[str, list[str]]:
    failures = {
        label: [p for p in problems if not allowed(p)]
        for label, problems in result["problems"].items()
    }
    return {label: problems for label, problems in failures.items() if problems}


async def test_the_sglang_fake_speaks_sglangs_definitions(
    sglang_protocol_python: Path, qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    """Both streaming modes (cumulative by default, `--incremental-streaming-output`)."""
    documents: list[Document] = []
    for incremental in (False, True):
        fake = FakeSGLang(
            qwen_tokenizer,
            deterministic=True,
            incremental_streaming_output=incremental,
            context_length=SGLANG_LIMITS.max_model_len,
        )
        url = await start_fake(fake)
        documents += await _documents(url, _sglang_traffic(), SGLANG_KINDS)
    kinds = {d["kind"] for d in documents}
    assert {"generate.stream_error", "openai.error", "completion.chunk", "chat.chunk"} <= kinds
    assert any(d["body"].get("usage") and not d["body"]["choices"] for d in documents
               if d["kind"] == "chat.chunk")  # fmt: skip
    refused = [d["body"] for d in documents if d["kind"] == "generate.response"
               and isinstance(d["body"], dict) and d["body"]["meta_info"]["finish_reason"]
               and d["body"]["meta_info"]["finish_reason"].get("status_code") == 400]  # fmt: skip
    assert refused, "the scheduler's streamed refusal was not answered"
    assert sum(d["kind"] == "openai.error" and d["label"].endswith("error")
               for d in documents) >= 2 * 6  # fmt: skip
    result = await _validate(sglang_protocol_python, "sglang", {"documents": documents}, tmp_path)
    assert set(result["problems"]) == {d["label"] for d in documents}
    assert _failures(result) == {}


VLLM_SPEC = {"id": "cmpl-1", "text": "Hi.", "tokens": ["Hi", "."], "ids": [13048, 13],
             "logprobs": [-0.25, -1.5], "prompt_ids": PROMPT_IDS, "prompt_tokens": 9,
             "finish_reason": "stop", "stop_reason": 151645}  # fmt: skip
VLLM_BUILDS = ("completion.response", "generate.response")


@pytest.fixture(scope="module")
async def vllm_checked(
    vllm_definitions_python: Path,
    fake_vllm: tuple[FakeVLLM, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Document], Json]:
    """The vLLM fake's traffic and the answers to build, through one driver run (importing
    vLLM takes seconds)."""
    documents = await _documents(fake_vllm[1], _vllm_traffic(), VLLM_KINDS)
    builds = [{"label": kind, "kind": kind, "spec": VLLM_SPEC} for kind in VLLM_BUILDS]
    work = {"documents": documents, "builds": builds}
    result = await _validate(vllm_definitions_python, "vllm", work, tmp_path_factory.mktemp("v"))
    return documents, result


async def test_the_vllm_fake_speaks_vllms_definitions(
    vllm_checked: tuple[list[Document], Json],
) -> None:
    documents, result = vllm_checked
    kinds = {d["kind"] for d in documents}
    assert {"openai.error", "completion.chunk", "chat.chunk", "generate.chunk"} <= kinds
    assert set(result["problems"]) == {d["label"] for d in documents}
    assert _failures(result, allowed=_newer) == {}


async def test_the_validators_report_what_the_definitions_do_not_allow(
    sglang_protocol_python: Path, tmp_path: Path
) -> None:
    """The checks can fail: unknown keys, wrong types, a meta_info key no server code sets."""
    documents = [
        {"label": "type", "kind": "generate.request", "body": {"input_ids": ["a"]}},
        {"label": "field", "kind": "generate.request", "body": {"text": "a", "max_tokens": 3}},
        {"label": "meta", "kind": "generate.response",
         "body": {"text": "", "meta_info": {"id": "r", "usage": {}}}},
        {"label": "chat", "kind": "chat.chunk",
         "body": {"id": "c", "created": 1, "model": "m", "choices": [], "token_ids": [1]}},
    ]  # fmt: skip
    result = await _validate(sglang_protocol_python, "sglang", {"documents": documents}, tmp_path)
    failures = _failures(result)
    assert failures.keys() == {"type", "field", "meta", "chat"}
    assert failures["type"][0].startswith("schema gate: invalid type: string")
    assert failures["field"] == ["max_tokens: not a field of GenerateReqInput"]
    assert any("meta_info.usage: set nowhere" in p for p in failures["meta"])
    model = "ChatCompletionStreamResponse"
    assert failures["chat"] == [f"{model}.token_ids: not declared by {model}"]


def _exchange(path: str, request: Json, response: Json, events: list[Json] | None) -> Exchange:
    """A finished exchange: `response` as a JSON body, or `events` as an event stream."""
    headers = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))
    stream = CIMultiDictProxy(CIMultiDict({"Content-Type": "text/event-stream"}))
    chunks = [orjson.dumps(response)]
    if events is not None:
        chunks = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    return Exchange(
        method="POST", path=path, query="", request_headers=headers, path_metadata=[],
        upstream="u", start=0.0, request_body=orjson.dumps(request), status=200,
        response_headers=headers if events is None else stream, response_chunks=chunks, end=1.0,
    )  # fmt: skip


def _parse(
    path: str, request: Json, response: Json = None, events: list[Json] | None = None
) -> Any:
    _, parser = DIALECTS[path]
    (parsed,) = parser(_exchange(path, request, response, events), request)
    return parsed.call


SGLANG_SPECS = {
    "stop": {"id": "r1", "text": "Hi.", "output_ids": [13048, 13], "logprobs": [-0.25, -1.5],
             "prompt_tokens": 9, "completion_tokens": 2, "cached_tokens": 4,
             "finish": {"type": "stop", "matched": 151645}, "weight_version": "7"},
    "length": {"id": "r2", "text": "a b", "output_ids": [64, 293], "logprobs": [-0.5, -0.75],
               "prompt_tokens": 9, "completion_tokens": 2,
               "finish": {"type": "length", "length": 2}},
    "abort": {"id": "r3", "text": "", "output_ids": [], "logprobs": [], "prompt_tokens": 9,
              "completion_tokens": 0, "finish": {"type": "abort", "message": "Aborted"}},
}  # fmt: skip
# A stream of the "stop" answer in two chunks, as SGLang sends it by default (each chunk holds
# everything so far) and with `--incremental-streaming-output` (each chunk its new tokens).
FIRST = {
    "id": "r1",
    "text": "Hi",
    "output_ids": [13048],
    "logprobs": [-0.25],
    "prompt_tokens": 9,
    "completion_tokens": 1,
    "finish": {},
}
STREAMS = {
    "cumulative": [FIRST, SGLANG_SPECS["stop"]],
    "incremental": [FIRST, {**SGLANG_SPECS["stop"], "text": ".", "output_ids": [13],
                            "logprobs": [-1.5]}],
}  # fmt: skip


async def test_the_sglang_parser_reads_generate_answers_where_the_contract_puts_them(
    sglang_protocol_python: Path, tmp_path: Path
) -> None:
    builds = [
        {"label": name, "kind": "generate.response", "spec": spec}
        for name, spec in SGLANG_SPECS.items()
    ] + [
        {"label": f"{mode} {k}", "kind": "generate.response", "spec": spec}
        for mode, chunks in STREAMS.items()
        for k, spec in enumerate(chunks)
    ]
    built = (await _validate(sglang_protocol_python, "sglang", {"builds": builds}, tmp_path))[
        "built"
    ]
    request = {"input_ids": PROMPT_IDS, "return_logprob": True}
    for name, spec in SGLANG_SPECS.items():
        call = _parse("/generate", request, built[name])
        (output,) = call.outputs
        assert (output.text or "") == spec["text"]  # an empty text is recorded as none
        assert output.token_ids == spec["output_ids"]
        assert output.logprobs == spec["logprobs"]
        assert output.finish_reason == spec["finish"]["type"]
        assert output.stop_reason == spec["finish"].get("matched")
        assert call.request_id == spec["id"]
        assert call.weight_version == spec.get("weight_version")
        assert call.usage == {
            "prompt_tokens": spec["prompt_tokens"],
            "completion_tokens": spec["completion_tokens"],
            "cached_tokens": spec.get("cached_tokens", 0),
        }
    batch = [{**built["stop"], "index": 0}, {**built["length"], "index": 1}]
    call = _parse("/generate", {"text": "a", "sampling_params": {"n": 2}}, batch)
    assert [o.token_ids for o in call.outputs] == [[13048, 13], [64, 293]]
    stop = SGLANG_SPECS["stop"]
    for mode in STREAMS:
        events = [built[f"{mode} 0"], built[f"{mode} 1"]]
        (output,) = _parse("/generate", {**request, "stream": True}, events=events).outputs
        assert (output.text, output.token_ids) == (stop["text"], stop["output_ids"]), mode
        assert output.logprobs == stop["logprobs"], mode
        assert (output.finish_reason, output.stop_reason) == ("stop", 151645), mode


async def test_the_vllm_parsers_read_answers_where_vllms_models_put_them(
    vllm_checked: tuple[list[Document], Json],
) -> None:
    built = vllm_checked[1]["built"]
    requests = {
        "completion.response": ("/v1/completions", {"prompt": PROMPT_IDS, "logprobs": 0}),
        "generate.response": ("/inference/v1/generate", {"token_ids": PROMPT_IDS}),
    }
    for kind, (path, request) in requests.items():
        call = _parse(path, request, built[kind])
        (output,) = call.outputs
        assert output.token_ids == VLLM_SPEC["ids"]
        assert output.logprobs == VLLM_SPEC["logprobs"]
        assert output.finish_reason == VLLM_SPEC["finish_reason"]
        assert output.stop_reason == VLLM_SPEC["stop_reason"]
        assert call.prompt.token_ids == PROMPT_IDS
        assert call.usage is not None and call.usage["completion_tokens"] == 2
