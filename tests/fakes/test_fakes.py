"""The fakes speak the documented wire formats (reference: inference-apis.md, checked against
the vllm 0.33.0 and sglang 0.5.23 sources), and real clients can use them.

Where the reference and the servers' source disagree, the source wins and the test says so.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from fakes import FakeSGLang, FakeVLLM, StartFake
from fakes.vllm import FIXED_CREATED

PROMPT = [785, 6722, 315, 9625, 374]  # "The capital of France is"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
IM_END, TOOL_CALL, END_TOOL_CALL = 151645, 151657, 151658

# Examples from inference-apis.md, verbatim (values are illustrative; keys, order and nulls are
# what the fakes must match).
REF_COMPLETION = json.loads("""
{"id":"cmpl-8c1f0e","object":"text_completion","created":1763800000,"model":"m",
 "choices":[{"index":0,"text":" Paris.","logprobs":{"text_offset":[0,6],"token_logprobs":[-0.0123,-0.51],"tokens":[" Paris","."],"top_logprobs":[{" Paris":-0.0123},{".":-0.51,",":-1.2}]},
   "finish_reason":"length","stop_reason":null,"token_ids":[12095,13],"prompt_logprobs":null,
   "prompt_token_ids":[785,6722,315,9625,374],"routed_experts":null,"weight_versions":null}],
 "service_tier":null,"system_fingerprint":"vllm-0.33.0-1a2b3c4d",
 "usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},
 "kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}
""")  # noqa: E501
REF_COMPLETION_STREAM = [
    json.loads(line)
    for line in (
        '{"id":"cmpl-8c1f0e","object":"text_completion","created":1763800000,"model":"m","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[785,6722,315,9625,374],"token_ids":[12095],"weight_versions":null}],"kv_transfer_params":null}',  # noqa: E501
        '{"id":"cmpl-8c1f0e","object":"text_completion","created":1763800000,"model":"m","choices":[{"index":0,"text":".","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":[13],"weight_versions":null}],"kv_transfer_params":null}',
        '{"id":"cmpl-8c1f0e","object":"text_completion","created":1763800000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2},"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}',
    )
]
REF_CHAT_TOOL_CALL = json.loads("""
{"id":"chatcmpl-5d2a","object":"chat.completion","created":1763800000,"model":"m",
 "choices":[{"index":0,
   "message":{"role":"assistant","content":null,"refusal":null,"annotations":null,"audio":null,"function_call":null,
     "tool_calls":[{"id":"chatcmpl-tool-9f3e","type":"function","function":{"name":"get_weather","arguments":"{\\"city\\": \\"Paris\\"}"}}],"reasoning":null},
   "logprobs":{"content":[{"token":"<tool_call>","logprob":-0.01,"bytes":[60,116,111,111,108,95,99,97,108,108,62],"top_logprobs":[{"token":"<tool_call>","logprob":-0.01,"bytes":[60,116,111,111,108,95,99,97,108,108,62]}]}]},
   "finish_reason":"tool_calls","stop_reason":null,"token_ids":[151657,198,151658,151645],"routed_experts":null,"weight_versions":null}],
 "service_tier":null,"system_fingerprint":"vllm-0.33.0-1a2b3c4d",
 "usage":{"prompt_tokens":180,"total_tokens":184,"completion_tokens":4,"prompt_tokens_details":null,"completion_tokens_details":null},
 "prompt_logprobs":null,"prompt_token_ids":[151644,872,198],"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}
""")  # noqa: E501
REF_GENERATE = json.loads("""
{"request_id":"generate-tokens-ab12","model":"m","created":1763800000,
 "usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},
 "prompt_logprobs":null,"prompt_token_id_logprobs":null,"prompt_token_ids":[785,6722,315,9625,374],"mm_placeholders":null,"metrics":null,
 "kv_transfer_params":null,"ec_transfer_params":null,"output_mode":"tokens",
 "choices":[{"index":0,"finish_reason":"length","stop_reason":null,"token_ids":[12095,13],"routed_experts":null,"sampling_mask":null,"weight_versions":null,
   "logprobs":{"content":[{"token_id":12095,"logprob":-0.0123,"rank":1,"top_logprobs":[{"token_id":12095,"logprob":-0.0123,"rank":1}]},{"token_id":13,"logprob":-0.51,"rank":1,"top_logprobs":[{"token_id":13,"logprob":-0.51,"rank":1}]}]}}]}
""")
REF_SGLANG_GENERATE = json.loads("""
{"text":" Paris.","output_ids":[12095,13],
 "meta_info":{"id":"rollout-42-0","finish_reason":{"type":"length","length":2},"prompt_tokens":5,"weight_version":"default","num_retractions":0,
  "input_token_logprobs":[],"output_token_logprobs":[[-0.0123,12095,null],[-0.51,13,null]],"output_token_logprobs_length":2,
  "input_top_logprobs":[],"output_top_logprobs":[[[-0.0123,12095,null]],[[-0.51,13,null]]],
  "reasoning_tokens":0,"completion_tokens":2,"cached_tokens":0,"e2e_latency":0.041,"response_sent_to_client_ts":1763800000.12}}
""")
SSE_BODY = re.compile(rb"^(?:(?:data: [^\n]+|: keep-alive)\n\n)+\Z")


DATA_KEYED = frozenset({"$.choices[].logprobs.top_logprobs[]"})  # keys are token strings


def assert_like(
    actual: Any, reference: Any, path: str = "$", not_null: frozenset[str] = frozenset()
) -> None:
    """Same keys in the same order, nulls where the reference has nulls, recursively."""
    if isinstance(reference, dict):
        assert isinstance(actual, dict), path
        if path in DATA_KEYED:
            return
        assert list(actual) == list(reference), path
        for key, value in reference.items():
            child = f"{path}.{key}"
            if value is None and child not in not_null:
                assert actual[key] is None, child
            elif value is not None:
                assert_like(actual[key], value, child, not_null)
    elif isinstance(reference, list) and reference and isinstance(reference[0], (dict, list)):
        assert isinstance(actual, list) and actual, path
        for item in actual:
            assert_like(item, reference[0], f"{path}[]", not_null)


async def post(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as response,
    ):
        return response.status, response.headers.get("Content-Type", ""), await response.read()


async def post_json(url: str, body: Any, status: int = 200) -> Any:
    code, content_type, raw = await post(url, body)
    assert code == status, raw
    assert content_type == "application/json"
    return json.loads(raw)


def events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, parsed; `[DONE]` kept as the string."""
    assert SSE_BODY.match(raw), raw[:300]
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            continue
        payload = block.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def stream(url: str, body: Any) -> list[Any]:
    code, content_type, raw = await post(url, body)
    assert code == 200, raw
    assert content_type == "text/event-stream; charset=utf-8"
    out = events(raw)
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# vLLM: /v1/completions
# ---------------------------------------------------------------------------------------------


async def test_completion_matches_reference(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_vllm
    request = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        "seed": 7,
    }
    body = await post_json(url + "/v1/completions", request)
    assert_like(body, REF_COMPLETION)
    choice = body["choices"][0]
    assert body["id"].startswith("cmpl-") and body["created"] == FIXED_CREATED
    assert body["model"] == "tiny-qwen"
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 2
    assert choice["prompt_token_ids"] == PROMPT
    assert decode(qwen_tokenizer, choice["token_ids"]) == choice["text"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [decode(qwen_tokenizer, [t]) for t in choice["token_ids"]]
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0])]
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2


async def test_deterministic_fake_repeats_itself_byte_for_byte(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    _, url = fake_vllm
    request = {"prompt": "Once upon a time", "max_tokens": 8}
    first, second = [await post(url + "/v1/completions", request) for _ in range(2)]
    assert first == second
    other = await post(url + "/v1/completions", {**request, "prompt": "Something else"})
    assert json.loads(other[2])["id"] != json.loads(first[2])["id"]
    random_ids = await start_fake(FakeVLLM(qwen_tokenizer))
    a, b = [await post_json(random_ids + "/v1/completions", request) for _ in range(2)]
    assert a["id"] != b["id"] and a["choices"] == b["choices"]  # same text, fresh ids


async def test_completion_stream_matches_reference(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_vllm
    chunks = await stream(
        url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        },
    )
    *content, usage = chunks
    assert_like(content[0], REF_COMPLETION_STREAM[0])
    for chunk in content[1:-1]:
        assert_like(chunk, REF_COMPLETION_STREAM[1])
        assert chunk["choices"][0]["finish_reason"] is None
    assert_like(content[-1], REF_COMPLETION_STREAM[1])
    assert_like(usage, REF_COMPLETION_STREAM[2])
    assert [c["choices"][0]["prompt_token_ids"] is not None for c in content] == [True] + [
        False
    ] * (len(content) - 1)
    ids = [t for c in content for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 4 and content[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in content) == decode(qwen_tokenizer, ids)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert len({c["id"] for c in chunks}) == 1


async def test_completion_stream_without_usage_stamps_fingerprint_on_last_chunk(
    fake_vllm: tuple[FakeVLLM, str],
) -> None:
    _, url = fake_vllm
    chunks = await stream(
        url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}
    )
    assert [list(c) for c in chunks[:-1]] == [
        ["id", "object", "created", "model", "choices", "kv_transfer_params"]
    ] * (len(chunks) - 1)
    assert list(chunks[-1]) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "system_fingerprint",
        "kv_transfer_params",
    ]
    assert chunks[-1]["choices"][0]["token_ids"] is None  # not requested


async def test_completion_batches_and_n(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_vllm
    body = await post_json(
        url + "/v1/completions",
        {
            "prompt": ["Hello there", "General Kenobi"],
            "n": 2,
            "max_tokens": 5,
            "return_token_ids": True,
        },
    )
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    hello = list(qwen_tokenizer.encode("Hello there"))
    assert [c["prompt_token_ids"] == hello for c in choices] == [True, True, False, False]
    assert body["usage"]["prompt_tokens"] == len(hello) + len(
        qwen_tokenizer.encode("General Kenobi")
    )
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert choices[0]["text"] != choices[1]["text"]  # n samples differ unless temperature is 0
    token_prompts = await post_json(
        url + "/v1/completions",
        {
            "prompt": [hello, PROMPT],
            "max_tokens": 5,
            "return_token_ids": True,
        },
    )
    assert token_prompts["choices"][0]["token_ids"] == choices[0]["token_ids"]
    chunks = await stream(
        url + "/v1/completions",
        {
            "prompt": ["Hello there", "General Kenobi"],
            "n": 2,
            "max_tokens": 3,
            "stream": True,
        },
    )
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}


async def test_request_id_from_header_and_body(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    _, _, raw = await post(
        url + "/v1/completions",
        {"prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "rollout-7"},
    )
    assert json.loads(raw)["id"] == "cmpl-rollout-7"
    body = await post_json(
        url + "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "request_id": "abc"}
    )
    assert body["id"] == "chatcmpl-abc"
    body = await post_json(
        url + "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "request_id": "g1"},
    )
    assert body["request_id"] == "generate-tokens-g1"


@pytest.mark.parametrize(
    ("path", "request_body", "error"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            {
                "message": "Stream options can only be defined when `stream=True`. "
                "(parameter=stream_options)",
                "type": "BadRequestError",
                "param": "stream_options",
                "code": 400,
            },
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "prompt_logprobs": 1},
            {
                "message": "`prompt_logprobs` are not available when `stream=True`. "
                "(parameter=prompt_logprobs)",
                "type": "BadRequestError",
                "param": "prompt_logprobs",
                "code": 400,
            },
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "stream": False, "stream_options": {"include_usage": True}},
            {
                "message": "Stream options can only be defined when `stream=True`. "
                "(parameter=stream_options)",
                "type": "BadRequestError",
                "param": "stream_options",
                "code": 400,
            },
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "stream": True, "prompt_logprobs": 2},
            {
                "message": "`prompt_logprobs` are not available when `stream=True`. "
                "(parameter=prompt_logprobs)",
                "type": "BadRequestError",
                "param": "prompt_logprobs",
                "code": 400,
            },
        ),
        (
            "/v1/completions",
            {"max_tokens": 3},
            {
                "message": "Either prompt or prompt_embeds must be provided and non-empty. "
                "(parameter=prompt)",
                "type": "BadRequestError",
                "param": "prompt",
                "code": 400,
            },
        ),
        (
            "/v1/chat/completions",
            {"model": "m"},
            {
                "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', "
                "'msg': 'Field required', 'input': '<dict of 1 items>'}",
                "type": "Bad Request",
                "param": "body.messages",
                "code": 400,
            },
        ),
        # The reference's second-turn example sends "tools": [], which vLLM 0.33 rejects.
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": []},
            {
                "message": "`tools` must not be an empty array. Either provide at least one "
                "tool or omit the field entirely. (parameter=tools)",
                "type": "BadRequestError",
                "param": "tools",
                "code": 400,
            },
        ),
        (
            "/inference/v1/generate",
            {"token_ids": PROMPT},
            {
                "message": "1 validation error:\n  {'type': 'missing', "
                "'loc': 'body.sampling_params', 'msg': 'Field required', "
                "'input': '<dict of 1 items>'}",
                "type": "Bad Request",
                "param": "body.sampling_params",
                "code": 400,
            },
        ),
        # `sampling_params: SamplingParams` (a msgspec model): pydantic tries it as an
        # instance and as a dict, and vLLM's handler reports both, the input summarised.
        (
            "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": None},
            {
                "message": "2 validation errors:\n  {'type': 'is_instance_of', "
                "'loc': 'body.sampling_params', 'msg': 'Input should be an instance of "
                "SamplingParams', 'input': 'None', 'ctx': {'class': 'SamplingParams'}}\n  "
                "{'type': 'dict_type', 'loc': 'body.sampling_params', 'msg': 'Input should be "
                "a valid dictionary', 'input': 'None'}",
                "type": "Bad Request",
                "param": "body.sampling_params",
                "code": 400,
            },
        ),
    ],
)
async def test_vllm_validation_errors(
    fake_vllm: tuple[FakeVLLM, str], path: str, request_body: Any, error: Any
) -> None:
    _, url = fake_vllm
    assert await post_json(url + path, request_body, status=400) == {"error": error}


async def test_vllm_finish_weight_update_takes_no_body_or_json(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    """`weight_version` is an optional embedded body field: no body is fine, a body that is not
    JSON is FastAPI's 400 (`json_invalid`), the version is taken from a JSON one."""
    url = await start_fake(FakeVLLM(qwen_tokenizer, model="m"))
    json_type = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/finish_weight_update") as response:
            assert response.status == 200
        async with session.post(
            url + "/finish_weight_update", data=b"not json", headers=json_type
        ) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        async with session.post(
            url + "/finish_weight_update", json={"weight_version": "v7"}
        ) as response:
            assert response.status == 200
        async with session.get(url + "/weight_info") as response:
            assert (await response.json())["weight_version"] == "v7"
    assert error["type"] == "Bad Request" and error["param"] == "body.0"
    assert "'type': 'json_invalid'" in error["message"]


async def test_vllm_rejects_non_json_content_type(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions", data=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"}
        ) as response,
    ):
        assert response.status == 400
        body = await response.json()
    assert body["error"]["type"] == "Bad Request"
    assert "Only 'application/json' is allowed" in body["error"]["message"]


# ---------------------------------------------------------------------------------------------
# vLLM: /v1/chat/completions
# ---------------------------------------------------------------------------------------------


async def test_chat_tool_call_matches_reference(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_vllm
    request = {
        "model": "m",
        "messages": USER,
        "tools": [WEATHER_TOOL],
        "max_completion_tokens": 64,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
        "seed": 7,
    }
    body = await post_json(url + "/v1/chat/completions", request)
    assert_like(body, REF_CHAT_TOOL_CALL)
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # json.dumps, as the parser does
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    ids = choice["token_ids"]
    assert ids[0] == TOOL_CALL and ids[-2:] == [END_TOOL_CALL, IM_END]
    text = decode(qwen_tokenizer, ids)
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert text == f"<tool_call>\n{call_text}\n</tool_call><|im_end|>"
    rendered = qwen_tokenizer.apply_chat_template(
        USER, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert body["prompt_token_ids"] == list(rendered)
    assert body["usage"]["prompt_tokens"] == len(rendered)
    assert len(choice["logprobs"]["content"]) == len(ids)
    assert choice["logprobs"]["content"][0]["token"] == "<tool_call>"


async def test_chat_plain_answer_without_tools(
    fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_vllm
    body = await post_json(
        url + "/v1/chat/completions", {"messages": USER, "return_token_ids": True}
    )
    choice = body["choices"][0]
    assert list(choice["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == IM_END
    assert decode(qwen_tokenizer, choice["token_ids"][:-1]) == choice["message"]["content"]
    assert "Weather in Paris?" in choice["message"]["content"]


async def test_chat_stream_tool_call_deltas(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    request = {"messages": USER, "tools": [WEATHER_TOOL], "return_token_ids": True}
    full = await post_json(url + "/v1/chat/completions", request)
    chunks = await stream(
        url + "/v1/chat/completions",
        {**request, "stream": True, "stream_options": {"include_usage": True}},
    )
    first, *middle, usage = chunks
    assert list(first) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "prompt_token_ids",
        "prompt_text",
    ]
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert first["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in middle)
    deltas = [c["choices"][0]["delta"] for c in middle]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0] == {
        "id": calls[0]["id"],
        "type": "function",
        "index": 0,
        "function": {"name": "get_weather"},
    }
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert all(list(tc) == ["index", "function"] for tc in calls[1:])
    arguments = "".join(tc["function"]["arguments"] for tc in calls[1:])
    assert arguments == full["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    last = middle[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    assert list(last) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "weight_versions",
    ]
    streamed_ids = [t for c in middle for t in c["choices"][0]["token_ids"]]
    assert streamed_ids == full["choices"][0]["token_ids"]
    assert usage["choices"] == [] and list(usage) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    ]
    assert usage["usage"]["completion_tokens"] == len(streamed_ids)


async def test_chat_stream_plain_content(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    full = await post_json(url + "/v1/chat/completions", {"messages": USER})
    chunks = await stream(url + "/v1/chat/completions", {"messages": USER, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[1]["choices"][0] == {
        "index": 0,
        "delta": {"content": chunks[1]["choices"][0]["delta"]["content"]},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": None,
    }
    assert chunks[-1]["system_fingerprint"] == full["system_fingerprint"]


async def test_agent_loop_calls_tools_then_answers(fake_vllm: tuple[FakeVLLM, str]) -> None:
    """A tool round per city until each named one was looked up, then an answer stating what
    the tools returned for the cities asked; the token-level route answers the rendered
    conversation (its calls read back from ChatML) with the same tokens."""
    _, url = fake_vllm
    question = "Weather in Oslo, Bergen and Tromso today?"
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    asked: list[str] = []
    rounds = 0
    for _ in range(6):
        body = await post_json(
            url + "/v1/chat/completions",
            {
                "messages": messages,
                "tools": [WEATHER_TOOL],
                "return_token_ids": True,
            },
        )
        message = body["choices"][0]["message"]
        generated = await post_json(
            url + "/inference/v1/generate",
            {
                "token_ids": body["prompt_token_ids"],
                "sampling_params": {},
            },
        )
        assert generated["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
        if not message.get("tool_calls"):
            break
        rounds += 1
        calls = message["tool_calls"]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:  # a result that leaves its city out, as a terse tool would
            asked.append(json.loads(call["function"]["arguments"])["city"])
            temp = 10 + len(asked)
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f'{{"temp_c": {temp}}}'}
            )
    assert 1 <= rounds <= 3 and len(asked) == 3
    assert sum(city in question for city in asked) >= 2  # a mistake, if any, is one city
    facts = "; ".join(f"{city} is {11 + n} C" for n, city in enumerate(asked))
    assert message["content"].startswith(facts + ".")


async def test_openai_client_chat_tools_stream_and_completions(
    fake_vllm: tuple[FakeVLLM, str],
) -> None:
    _, url = fake_vllm
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    try:
        response = await client.chat.completions.create(
            model="tiny-qwen",
            messages=USER,
            tools=[WEATHER_TOOL],
            extra_body={"return_token_ids": True},
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (
            choice.message.tool_calls
            and choice.message.tool_calls[0].function.name == "get_weather"
        )
        assert (choice.model_extra or {})["token_ids"][-1] == IM_END
        calls: dict[int, dict[str, str]] = {}
        finish = None
        chunks = await client.chat.completions.create(
            model="tiny-qwen",
            messages=USER,
            tools=[WEATHER_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += (tc.function and tc.function.name) or ""
                    entry["arguments"] += (tc.function and tc.function.arguments) or ""
        assert finish == "tool_calls" and usage is not None
        assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        completion = await client.completions.create(
            model="tiny-qwen", prompt="Hello", max_tokens=5
        )
        assert (
            completion.choices[0].text
            and completion.usage
            and completion.usage.completion_tokens == 5
        )
        texts = []
        async for part in await client.completions.create(
            model="tiny-qwen", prompt="Hello", max_tokens=5, stream=True
        ):
            texts.extend(c.text for c in part.choices)
        assert "".join(texts) == completion.choices[0].text
    finally:
        await client.close()


# ---------------------------------------------------------------------------------------------
# vLLM: /inference/v1/generate, small routes, RL control
# ---------------------------------------------------------------------------------------------


async def test_generate_matches_reference(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    request = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 2, "temperature": 0, "logprobs": 1},
        "return_token_ids": True,
        "output_mode": "tokens",
        "stream": False,
    }
    body = await post_json(url + "/inference/v1/generate", request)
    # vLLM's engine stamps every finished output with its weight version ("default" until an
    # update), and /generate returns it unconditionally: the reference's null is not what
    # vllm 0.33 sends.
    not_null = frozenset({"$.choices[].weight_versions"})
    assert_like(body, REF_GENERATE, not_null=not_null)
    choice = body["choices"][0]
    assert body["request_id"].startswith("generate-tokens-")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]


async def test_generate_stream(fake_vllm: tuple[FakeVLLM, str]) -> None:
    _, url = fake_vllm
    chunks = await stream(
        url + "/inference/v1/generate",
        {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 3},
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *content, usage = chunks
    assert list(content[0]) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert content[0]["prompt_token_ids"] == PROMPT
    assert all(list(c) == ["request_id", "usage", "output_mode", "choices"] for c in content[1:])
    assert [len(c["choices"][0]["token_ids"]) for c in content] == [1, 1, 1]
    assert content[-1]["choices"][0]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 3}
    ]
    assert usage == {
        "request_id": content[0]["request_id"],
        "output_mode": "tokens",
        "choices": [],
        "usage": {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3},
    }


async def test_small_routes(fake_vllm: tuple[FakeVLLM, str], qwen_tokenizer: Any) -> None:
    _, url = fake_vllm
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as response:
            assert response.status == 200 and await response.read() == b""
        async with session.get(url + "/version") as response:
            assert await response.json() == {"version": "0.33.0"}
        async with session.get(url + "/v1/models") as response:
            models = await response.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-qwen"
    assert list(models["data"][0]) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    tokens = await post_json(url + "/tokenize", {"prompt": "Hello world"})
    assert tokens == {
        "count": 2,
        "max_model_len": 32768,
        "tokens": [9707, 1879],
        "token_strs": None,
    }
    chat = await post_json(url + "/tokenize", {"messages": USER, "tools": [WEATHER_TOOL]})
    rendered = qwen_tokenizer.apply_chat_template(
        USER, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert chat["tokens"] == list(rendered)
    assert await post_json(url + "/detokenize", {"tokens": [9707, 1879]}) == {
        "prompt": "Hello world"
    }


async def test_weight_versions_follow_updates(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    for path, body, reply in (
        ("/start_weight_update", {}, {"message": "Weight update started"}),
        ("/update_weights", {"update_info": {}}, {"message": "Weights updated"}),
        ("/finish_weight_update", {"weight_version": "v3"}, {"message": "Weight update finished"}),
    ):
        assert await post_json(url + path, body) == reply
    chat = await post_json(
        url + "/v1/chat/completions",
        {"messages": USER, "return_weight_versions": True, "return_token_ids": True},
    )
    n = len(chat["choices"][0]["token_ids"])
    assert chat["choices"][0]["weight_versions"] == [{"version": "v3", "start": 0, "end": n}]
    reply = await post_json(url + "/update_weight_version", {"new_version": "v4"})
    assert reply == {"success": True, "new_version": "v4"}
    # A version change while a request is held by a keep-mode pause splits its span.
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            url + "/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 100,
                "ignore_eos": True,
                "stream": True,
                "return_weight_versions": True,
                "return_token_ids": True,
            },
        )
        head = await response.content.readuntil(b"\n\n")
        await session.post(url + "/pause?mode=keep")
        await session.post(url + "/update_weight_version", json={"new_version": "v5"})
        await session.post(url + "/resume")
        chunks = events(head + await response.read())[:-1]
    spans = chunks[-1]["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["v4", "v5"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == 100


async def test_pause_abort_mode(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    long = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(url + "/v1/completions", json=long)
        head = await response.content.readuntil(b"\n\n")
        async with session.post(url + "/pause") as paused:
            assert await paused.json() == {"status": "paused"}
        chunks = events(head + await response.read())[:-1]
        async with session.get(url + "/is_paused") as state:
            assert await state.json() == {"is_paused": True}
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert 1 <= len(chunks) < 500
    rejected = await post_json(url + "/v1/completions", {"prompt": "x"}, status=503)
    assert rejected == {
        "error": {
            "message": "Generation is paused. Please retry after it resumes.",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    streamed = await stream(url + "/v1/completions", {"prompt": "x", "stream": True})
    assert streamed == [rejected]
    assert await post_json(url + "/resume", None) == {"status": "resumed"}
    assert (await post_json(url + "/v1/completions", {"prompt": "x"}))["choices"]


async def test_abort_requests_route(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            url + "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 300, "ignore_eos": True, "stream": True},
            headers={"X-Request-Id": "victim"},
        )
        head = await response.content.readuntil(b"\n\n")
        async with session.post(
            url + "/abort_requests", json={"request_ids": ["chatcmpl-victim"]}
        ) as aborted:
            assert await aborted.json() == {"status": "aborted", "aborted": 1}
        chunks = events(head + await response.read())[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert fake.aborted == []  # server-side aborts are not client disconnects


async def test_error_injection_mid_stream(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    url = await start_fake(FakeVLLM(qwen_tokenizer, error_after_chunks=2))
    code, _, raw = await post(url + "/v1/chat/completions", {"messages": USER, "stream": True})
    assert code == 200
    blocks = raw.decode().split("\n\n")
    assert len(blocks) == 5 and blocks[3:] == ["data: [DONE]", ""]
    # chat serializes its ErrorResponse with pydantic (compact) ...
    assert blocks[2] == (
        'data: {"error":{"message":"Internal server error",'
        '"type":"InternalServerError","param":null,"code":500}}'
    )
    chunks = await stream(url + "/v1/completions", {"prompt": "x", "stream": True})
    assert chunks[-1] == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    _, _, raw = await post(url + "/v1/completions", {"prompt": "x", "stream": True})
    # ... completions and generate with json.dumps (default separators)
    assert b'data: {"error": {"message": "Internal server error", "type"' in raw
    failed = await post_json(url + "/v1/completions", {"prompt": "x"}, status=500)
    assert failed["error"]["type"] == "InternalServerError"


async def test_keepalive_comments(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    url = await start_fake(FakeVLLM(qwen_tokenizer, keepalive_comments=True))
    _, _, raw = await post(
        url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}
    )
    assert raw.count(b": keep-alive\n\n") == 2  # between the three chunks
    assert len(events(raw)) == 4


async def test_api_key(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    url = await start_fake(FakeVLLM(qwen_tokenizer, api_key="sk-test"))
    assert await post_json(url + "/v1/completions", {"prompt": "x"}, status=401) == {
        "error": "Unauthorized"
    }
    code, _, _ = await post(
        url + "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer sk-test"}
    )
    assert code == 200
    assert (await post(url + "/tokenize", {"prompt": "x"}))[0] == 200  # not under /v1


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"]
)
async def test_client_disconnect_is_recorded(
    qwen_tokenizer: Any, start_fake: StartFake, path: str
) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    body = {
        "prompt": "x",
        "messages": USER,
        "token_ids": PROMPT,
        "ignore_eos": True,
        "max_tokens": 2000,
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        response = await session.post(url + path, json=body)
        first = json.loads((await response.content.readuntil(b"\n\n"))[6:])
        response.close()
    aborted = await fake.wait_aborted()
    assert aborted == [first.get("id") or first.get("request_id")]
    await fake.engine.drained()


async def test_non_streaming_disconnect_is_recorded(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(
            session.post(
                url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True},
                headers={"X-Request-Id": "gone"},
            )
        )
        await fake.wait_in_flight()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    assert await fake.wait_aborted() == ["cmpl-gone"]


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------

# meta_info key order of a finished /generate output with logprobs, as the tokenizer manager
# builds it. The reference omits `weight_versions`, which sglang 0.5.23 adds to every finished
# output (the output streamer always computes the spans).
SGLANG_FINAL_META = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "input_top_logprobs",
    "output_top_logprobs",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "e2e_latency",
    "response_sent_to_client_ts",
]


async def test_sglang_generate_matches_reference(
    fake_sglang: tuple[FakeSGLang, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_sglang
    request = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 1,
        "rid": "rollout-42-0",
    }
    body = await post_json(url + "/generate", request)
    assert list(body) == list(REF_SGLANG_GENERATE)
    meta = body["meta_info"]
    assert list(meta) == SGLANG_FINAL_META
    reference_keys = [k for k in SGLANG_FINAL_META if k != "weight_versions"]
    assert reference_keys == list(REF_SGLANG_GENERATE["meta_info"])
    assert meta["id"] == "rollout-42-0" and meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["weight_version"] == "default" and meta["input_token_logprobs"] == []
    assert [(e[1], e[2]) for e in meta["output_token_logprobs"]] == [
        (t, None) for t in body["output_ids"]
    ]
    assert [top[0] for top in meta["output_top_logprobs"]] == meta["output_token_logprobs"]
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
    assert body["text"] == decode(qwen_tokenizer, body["output_ids"])


async def test_sglang_stop_and_logprob_text(
    fake_sglang: tuple[FakeSGLang, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_sglang
    body = await post_json(
        url + "/generate",
        {
            "text": "Hello",
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "return_prompt_token_ids": True,
        },
    )
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert body["output_ids"][-1] == IM_END and body["text"] == decode(
        qwen_tokenizer, body["output_ids"][:-1]
    )
    assert [e[2] for e in meta["output_token_logprobs"]] == [
        decode(qwen_tokenizer, [t]) for t in body["output_ids"]
    ]
    assert "output_top_logprobs" not in meta  # only with top_logprobs_num > 0
    assert list(body) == ["text", "output_ids", "meta_info", "prompt_token_ids"]
    assert body["prompt_token_ids"] == list(qwen_tokenizer.encode("Hello"))
    word = body["text"].split()[1]
    stopped = await post_json(
        url + "/generate", {"text": "Hello", "sampling_params": {"stop": word}}
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in stopped["text"] and body["text"].startswith(stopped["text"])


async def test_sglang_cumulative_stream(fake_sglang: tuple[FakeSGLang, str]) -> None:
    _, url = fake_sglang
    chunks = await stream(
        url + "/generate",
        {
            "input_ids": PROMPT,
            "stream": True,
            "rid": "r1",
            "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True,
        },
    )
    assert len(chunks) == 4
    for i, chunk in enumerate(chunks, start=1):
        assert list(chunk) == ["text", "output_ids", "meta_info"]
        assert len(chunk["output_ids"]) == i  # cumulative
        assert len(chunk["meta_info"]["output_token_logprobs"]) == i
        assert chunk["meta_info"]["completion_tokens"] == i
        assert chunk["text"].startswith(chunks[i - 2]["text"] if i > 1 else "")
    for chunk in chunks[:-1]:
        assert chunk["meta_info"]["finish_reason"] is None
        assert "e2e_latency" not in chunk["meta_info"]
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 4} and "e2e_latency" in final
    assert ["response_sent_to_client_ts" in c["meta_info"] for c in chunks] == [
        True,
        False,
        False,
        False,
    ]


async def test_sglang_incremental_stream(
    qwen_tokenizer: Any, start_fake: StartFake, fake_sglang: tuple[FakeSGLang, str]
) -> None:
    url = await start_fake(
        FakeSGLang(qwen_tokenizer, deterministic=True, incremental_streaming_output=True)
    )
    request = {
        "input_ids": PROMPT,
        "stream": True,
        "rid": "r1",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4},
    }
    chunks = await stream(url + "/generate", request)
    cumulative = await stream(fake_sglang[1] + "/generate", request)
    assert [len(c["output_ids"]) for c in chunks] == [1, 1, 1, 1]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 1, 1, 1]
    assert chunks[-1]["meta_info"]["output_token_logprobs_length"] == 4
    assert "".join(c["text"] for c in chunks) == cumulative[-1]["text"]
    assert [t for c in chunks for t in c["output_ids"]] == cumulative[-1]["output_ids"]


async def test_sglang_batches_and_n_return_lists(fake_sglang: tuple[FakeSGLang, str]) -> None:
    _, url = fake_sglang
    body = await post_json(
        url + "/generate",
        {"text": ["a", "b"], "rid": "job", "sampling_params": {"max_new_tokens": 2}},
    )
    assert isinstance(body, list) and [o["meta_info"]["id"] for o in body] == ["job_0", "job_1"]
    body = await post_json(
        url + "/generate",
        {
            "input_ids": [PROMPT, PROMPT[:3]],
            "rid": ["x", "y"],
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert [o["meta_info"]["id"] for o in body] == ["x", "y"]
    body = await post_json(
        url + "/generate",
        {"text": "solo", "rid": "ignored", "sampling_params": {"max_new_tokens": 3, "n": 3}},
    )
    ids = [o["meta_info"]["id"] for o in body]
    assert len(body) == 3 and len(set(ids)) == 3  # n > 1: every sample gets a fresh uuid hex
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    chunks = await stream(
        url + "/generate",
        {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 3, "n": 2}},
    )
    assert {c["index"] for c in chunks} == {0, 1, 2, 3}
    assert all(list(c)[-1] == "index" for c in chunks)
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("request_body", "error"),
    [
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 2, "foo": 1}},
            "unknown field `foo`, expected one of `max_new_tokens`, `stop`",
        ),
        (
            {"text": 5},
            "invalid type: integer `5`, expected a value or an array of values for StringOrList",
        ),
        ({"input_ids": [1, "2"]}, 'invalid type: string "2", expected i64'),
        ({"text": "x", "stream": "yes"}, 'invalid type: string "yes", expected a boolean'),
        ({"text": "x", "return_prompt_token_ids": None}, "invalid type: null, expected a boolean"),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 1.5}},
            "invalid type: floating point `1.5`, expected i64",
        ),
    ],
)
async def test_sglang_schema_violations(
    fake_sglang: tuple[FakeSGLang, str], request_body: Any, error: str
) -> None:
    _, url = fake_sglang
    body = await post_json(url + "/generate", request_body, status=400)
    assert list(body) == ["error"] and body["error"].startswith(error)


async def test_sglang_normalization_errors(fake_sglang: tuple[FakeSGLang, str]) -> None:
    _, url = fake_sglang
    message = "Either text, input_ids or input_embeds should be provided."
    assert await post_json(url + "/generate", {"sampling_params": {}}, status=400) == {
        "error": {"message": message}
    }
    streamed = await stream(url + "/generate", {"stream": True})  # raised after the 200
    assert streamed == [
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }
    ]
    mismatch = await post_json(
        url + "/generate", {"text": ["a", "b"], "rid": ["only-one"]}, status=400
    )
    assert "rids length mismatch" in mismatch["error"]["message"]


async def test_sglang_weight_updates_and_control_routes(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    fake = FakeSGLang(qwen_tokenizer)
    url = await start_fake(fake)
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert await post_json(url + "/init_weights_update_group", group) == {
        "success": True,
        "message": "Succeeded to initialize custom process group.",
    }
    update = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[1]], "weight_version": "v2"}
    assert await post_json(url + "/update_weights_from_distributed", update) == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to v2.",
    }
    body = await post_json(
        url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    )
    assert body["meta_info"]["weight_version"] == "v2"
    assert body["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 2}]
    assert await post_json(url + "/update_weight_version", {"new_version": "v3"}) == {
        "success": True,
        "message": "Weight version updated to v3",
        "new_version": "v3",
    }
    disk = await post_json(url + "/update_weights_from_disk", {"model_path": "/m"})
    assert disk == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    info = await post_json(url + "/pause_generation", {"mode": "retract"})
    assert info == {"message": "Generation paused successfully.", "status": "ok"}
    assert fake.engine.paused
    assert (await post_json(url + "/continue_generation", {}))["status"] == "ok"
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/flush_cache") as response:
            assert response.status == 200
            assert (await response.text()).startswith("Cache flushed.\n")
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            async with session.post(url + path, json={}) as response:
                assert await response.read() == b"null"
        async with session.get(url + "/model_info") as response:
            assert (await response.json())["weight_version"] == "v3"
        async with session.get(url + "/get_model_info") as response:
            assert (await response.json())["model_path"] == "tiny-qwen"
        async with session.get(url + "/server_info") as response:
            assert (await response.json())["version"] == "0.5.23"
        async with session.post(url + "/workers", json={"url": "http://w1:30000"}) as response:
            assert response.status == 200
        async with session.post(url + "/add_worker?url=http://w2:30000") as response:
            assert response.status == 200
        async with session.get(url + "/list_workers") as response:
            assert await response.json() == {"urls": ["http://w1:30000", "http://w2:30000"]}
        async with session.delete(url + "/workers/http://w1:30000") as response:
            assert response.status == 200
    assert fake.workers == ["http://w2:30000"]


async def test_sglang_abort_request_by_rid_prefix(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    fake = FakeSGLang(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            url + "/generate",
            json={
                "text": ["a", "b"],
                "rid": "job",
                "stream": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            },
        )
        head = await response.content.readuntil(b"\n\n")
        async with session.post(url + "/abort_request", json={"rid": "job"}) as aborted:
            assert aborted.status == 200 and await aborted.read() == b""
        chunks = events(head + await response.read())[:-1]
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["meta_info"]["id"] for c in finals) == ["job_0", "job_1"]
    assert all(c["meta_info"]["finish_reason"]["type"] == "abort" for c in finals)


async def test_sglang_client_disconnect_is_recorded(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    fake = FakeSGLang(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            url + "/generate",
            json={
                "input_ids": PROMPT,
                "rid": "drop-me",
                "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            },
        )
        await response.content.readuntil(b"\n\n")
        response.close()
    assert await fake.wait_aborted() == ["drop-me"]


async def test_sglang_error_injection(qwen_tokenizer: Any, start_fake: StartFake) -> None:
    url = await start_fake(FakeSGLang(qwen_tokenizer, error_after_chunks=1))
    chunks = await stream(url + "/generate", {"text": "x", "stream": True})
    assert len(chunks) == 2 and chunks[-1]["error"]["code"] == 500


async def test_sglang_openai_routes(
    fake_sglang: tuple[FakeSGLang, str], qwen_tokenizer: Any
) -> None:
    _, url = fake_sglang
    chat = await post_json(
        url + "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER_TOOL], "return_token_ids": True},
    )
    assert re.fullmatch(r"[0-9a-f]{32}", chat["id"])  # the bare rid: no "chatcmpl-"
    assert list(chat) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    choice = chat["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "matched_stop",
        "prompt_token_ids",
        "response_token_ids",
    ]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["content"] == ""  # SGLang never sends null content
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    rendered = qwen_tokenizer.apply_chat_template(
        USER, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert choice["prompt_token_ids"] == list(rendered)
    assert choice["response_token_ids"][-1] == IM_END
    assert list(chat["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
        "completion_tokens_details",
    ]
    plain = await post_json(url + "/v1/chat/completions", {"messages": USER})
    assert plain["choices"][0]["matched_stop"] == IM_END
    assert plain["metadata"]["weight_version"] == "default"
    refused = await post_json(
        url + "/v1/chat/completions",
        {"messages": USER, "stream": True, "return_token_ids": True},
        status=400,
    )
    assert refused["object"] == "error" and "not supported with streaming" in refused["message"]
    completion = await post_json(
        url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "return_token_ids": True}
    )
    assert list(completion["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "matched_stop",
        "token_ids",
        "prompt_token_ids",
    ]
    chunks = await stream(
        url + "/v1/chat/completions",
        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["matched_stop"] == IM_END
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


# What SGLang 0.5.23 refuses, and how (each case read in its source: the tokenizer manager's
# `_validate_one_request`, the scheduler's `validate_input_length`, `_handle_batch_request`,
# the serving classes' `_validate_request` and `handle_request`, FastAPI's validation).
SMALL_CONTEXT = 64  # `--context-length`: the scheduler refuses prompts of 58 tokens and more


@pytest.fixture
async def small_sglang(qwen_tokenizer: Any, start_fake: StartFake) -> tuple[FakeSGLang, str]:
    fake = FakeSGLang(qwen_tokenizer, deterministic=True, context_length=SMALL_CONTEXT)
    return fake, await start_fake(fake)


async def test_sglang_generate_an_empty_text_batch_answers_an_empty_list(
    small_sglang: tuple[FakeSGLang, str],
) -> None:
    """`"text": []` is a batch of none: nothing is tokenized or sent, the answer is `[]`."""
    _, url = small_sglang
    assert await post_json(url + "/generate", {"text": []}) == []
    assert await stream(url + "/generate", {"text": [], "stream": True}) == []


async def test_sglang_generate_refuses_prompts_the_context_cannot_hold(
    small_sglang: tuple[FakeSGLang, str],
) -> None:
    fake, url = small_sglang
    too_long = {"input_ids": list(range(1, SMALL_CONTEXT + 1))}
    body = await post_json(url + "/generate", too_long, status=400)
    assert body == {
        "error": {
            "message": "The input (64 tokens) is longer than the model's context length "
            "(64 tokens)."
        }
    }
    streamed = await stream(url + "/generate", {**too_long, "stream": True})
    assert [c["error"]["code"] for c in streamed] == [400]
    overrun = {"input_ids": list(range(1, 41)), "sampling_params": {"max_new_tokens": 30}}
    body = await post_json(url + "/generate", overrun, status=400)
    assert body["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens. "
        "You requested a total of 70 tokens: 40 tokens from the input messages and 30 tokens"
    )
    reserve = {"input_ids": list(range(1, 59)), "rid": "near-full"}  # 58 >= 64 - 6
    body = await post_json(url + "/generate", reserve, status=400)
    assert body == {
        "error": {
            "message": "Input length (58 tokens) exceeds the maximum allowed length (58 "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        }
    }
    (chunk,) = await stream(url + "/generate", {**reserve, "stream": True})
    assert chunk["output_ids"] == [] and chunk["meta_info"]["prompt_tokens"] == 1
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": body["error"]["message"],
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    fits = await post_json(url + "/generate", {"input_ids": list(range(1, 51))})
    assert len(fits["output_ids"]) <= SMALL_CONTEXT - 2 - 50  # the scheduler's budget
    assert not fake.crashed


async def test_sglang_an_empty_prompt_kills_the_server(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    """Nothing refuses an empty prompt before the scheduler, whose forward pass fails on it:
    the server exits, cutting every connection, the one generating too."""
    fake = FakeSGLang(qwen_tokenizer, token_delay=0.01)
    url = await start_fake(fake)
    async with aiohttp.ClientSession() as session:
        generating = await session.post(
            url + "/generate",
            json={"text": "Hi", "stream": True, "rid": "busy",
                  "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}},
        )  # fmt: skip
        await generating.content.readuntil(b"\n\n")
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await session.post(url + "/generate", json={"input_ids": [[]]})
        with pytest.raises(aiohttp.ClientPayloadError):
            await generating.read()
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await session.get(url + "/health")
    assert fake.crashed and fake.aborted == []  # the server died; no client left


@pytest.mark.parametrize(
    "body", [{"text": ""}, {"input_ids": [[], [1, 2]]}, {"text": ["a", ""], "stream": True}]
)
async def test_sglang_every_empty_prompt_reaches_the_scheduler(
    small_sglang: tuple[FakeSGLang, str], body: Any
) -> None:
    fake, url = small_sglang
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await session.post(url + "/generate", json=body)
    assert fake.crashed


@pytest.mark.parametrize(
    ("path", "body", "error_type", "message"),
    [
        ("/v1/completions", {"prompt": ""}, "BadRequestError", "Prompt cannot be empty"),
        ("/v1/completions", {"prompt": [0]}, "BadRequestError", "Prompt cannot be empty"),
        ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "Bad Request",
         "1 validation error:\n  {'type': 'value_error', 'loc': ('body', 'max_tokens'), "
         "'msg': 'Value error, max_tokens must be positive'"),
        ("/v1/completions", {"max_tokens": 3}, "Bad Request",
         "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'prompt')"),
        ("/v1/completions", [1, 2], "Bad Request",
         "1 validation error:\n  {'type': 'model_attributes_type', 'loc': ('body',)"),
        ("/v1/completions", {"prompt": list(range(1, 60)), "max_tokens": 1},
         "BadRequestError", "Input length (59 tokens) exceeds the maximum allowed length"),
        ("/v1/completions", {"prompt": list(range(1, 60))}, "BadRequestError",
         "Requested token count exceeds the model's maximum context length of 64 tokens."),
        ("/v1/completions", {"prompt": list(range(1, 65)), "stream": True},
         "BadRequestError", "The input (64 tokens)"),  # refused before the stream's 200
        ("/v1/chat/completions", {"messages": []}, "BadRequestError",
         "Messages cannot be empty."),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"},
         "BadRequestError", "Tools cannot be empty if tool choice is set to required."),
        ("/v1/chat/completions", {"model": "m"}, "Bad Request",
         "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'messages')"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 80}]},
         "BadRequestError", "The input ("),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "word " * 80}], "stream": True},
         "BadRequestError", "The input ("),
        ("/v1/chat/completions", {"messages": USER, "stream": True, "return_token_ids": True},
         "BadRequest", "return_token_ids is not supported with streaming"),
    ],
)  # fmt: skip
async def test_sglang_openai_routes_refuse_with_json_400s(
    small_sglang: tuple[FakeSGLang, str], path: str, body: Any, error_type: str, message: str
) -> None:
    _, url = small_sglang
    error = await post_json(url + path, body, status=400)
    assert list(error) == ["object", "message", "type", "param", "code"]
    assert error["object"] == "error" and error["code"] == 400 and error["param"] is None
    assert error["type"] == error_type and error["message"].startswith(message)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_sglang_openai_routes_refuse_what_fastapi_cannot_read(
    small_sglang: tuple[FakeSGLang, str], path: str
) -> None:
    _, url = small_sglang
    async with aiohttp.ClientSession() as session:
        for data, content_type, text in (
            (b'{"prompt": ', "application/json", "'type': 'json_invalid', 'loc': ('body', 11)"),
            (b'{"prompt": "x"}', "text/plain", "Unsupported Media Type"),
        ):
            headers = {"Content-Type": content_type}
            async with session.post(url + path, data=data, headers=headers) as response:
                assert response.status == 400
                assert response.content_type == "application/json"
                error = await response.json()
            assert error["type"] == "Bad Request" and text in error["message"]


async def test_sglang_openai_streams_refused_by_the_scheduler_send_its_error(
    small_sglang: tuple[FakeSGLang, str],
) -> None:
    """A prompt within the scheduler's reserve passes the manager, so the stream has begun:
    its one event is the abort's error (`create_streaming_error_response`), then usage."""
    _, url = small_sglang
    ids = list(range(1, 60))
    chat = [{"role": "user", "content": "word " * 50}]
    for path, body in (
        ("/v1/completions", {"prompt": ids[:-1], "max_tokens": 1}),  # 58 tokens
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 1}),
    ):
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        error, usage = await stream(url + path, request)
        assert error["error"]["type"] == "BAD_REQUEST" and error["error"]["code"] == 400
        assert error["error"]["message"].startswith("Input length (")
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 0


async def test_sglang_openai_streams_cut_by_abort_request_end_with_abort(
    qwen_tokenizer: Any, start_fake: StartFake
) -> None:
    """`/abort_request` ends a request gracefully (`FINISH_ABORT()`, no status code): both
    serving classes send the abort as an ordinary last chunk, `finish_reason` `"abort"`."""
    fake = FakeSGLang(qwen_tokenizer, token_delay=0.005)
    url = await start_fake(fake)
    long = {"max_tokens": 2000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    requests = (
        ("/v1/completions", {"prompt": "Hello", "rid": "cmpl-cut", "return_token_ids": True}),
        ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "rid": "chat-cut"}),
    )
    async with aiohttp.ClientSession() as session:
        for path, body in requests:
            response = await session.post(url + path, json={**body, **long})
            head = await response.content.readuntil(b"\n\n")
            async with session.post(url + "/abort_request", json={"rid": body["rid"]}) as cut:
                assert cut.status == 200
            chunks = events(head + await response.read())
            assert chunks[-1] == "[DONE]"
            *deltas, last, usage = chunks[:-1]
            assert usage["choices"] == [] and 0 < usage["usage"]["completion_tokens"] < 2000
            (choice,) = last["choices"]
            assert choice["finish_reason"] == "abort" and choice["matched_stop"] is None
            assert all(d["choices"][0]["finish_reason"] is None for d in deltas)
            if path == "/v1/completions":
                assert choice["text"] == "" and choice["token_ids"] == []
                sent = sum(len(d["choices"][0]["token_ids"]) for d in deltas)
                assert sent == usage["usage"]["completion_tokens"]
