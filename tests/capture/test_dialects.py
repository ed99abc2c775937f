"""Every dialect through the proxy: byte-identical answers, and records that say what happened.

The fakes are deterministic (ids from the request, fixed `created`), so a direct call and a
proxied call of the same request must agree on every byte of status, headers and body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from fakes import FakeSGLang, FakeVLLM, StartFake
from openai import AsyncOpenAI
from support.proxies import all_calls, events, running_proxy, trajectories

from trace_proxy.capture.dialects.common import as_int_list

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
CHAT = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
KEY = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0"}


def headers_of(response: aiohttp.ClientResponse) -> tuple[list[tuple[str, str]], set[str]]:
    """End-to-end headers in order, and the framing headers the proxy regenerates for its own
    connection (RFC 9110 hop-by-hop), which keep their values but may move."""
    framing = {"transfer-encoding", "connection", "keep-alive"}
    items = [(k, v) for k, v in response.headers.items() if k.lower() != "date"]
    return (
        [(k, v) for k, v in items if k.lower() not in framing],
        {f"{k}: {v}" for k, v in items if k.lower() in framing},
    )


async def same_bytes(upstream: str, proxy: str, path: str, body: Json, headers: Json) -> bytes:
    """POST direct and through the proxy; every byte but the Date header must agree."""
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(upstream + path, json=body) as direct:
            direct_bytes, direct_status = await direct.read(), direct.status
            direct_headers = headers_of(direct)
        async with session.post(proxy + path, json=body, headers=headers) as proxied:
            proxied_bytes = await proxied.read()
            assert proxied.status == direct_status
            assert headers_of(proxied) == direct_headers
    assert proxied_bytes == direct_bytes
    return proxied_bytes


def without_call_ids(value: Any) -> Any:
    """Tool-call ids are minted per request by the server, so two requests never share one."""
    if isinstance(value, list):
        return [without_call_ids(v) for v in value]
    if isinstance(value, dict):
        return {
            k: without_call_ids(v)
            for k, v in value.items()
            if not (k == "id" and str(v).startswith("chatcmpl-tool-"))
        }
    return value


def sse(body: bytes) -> list[Any]:
    return [
        orjson.loads(block[6:])
        for block in body.split(b"\n\n")
        if block.startswith(b"data: ") and block[6:] != b"[DONE]"
    ]


VLLM_CASES: dict[str, tuple[str, Json]] = {
    "chat-tools": (
        "/v1/chat/completions",
        {**CHAT, "tools": TOOLS, "logprobs": True, "top_logprobs": 1, "return_token_ids": True},
    ),
    "chat-n2": ("/v1/chat/completions", {**CHAT, "n": 2, "return_token_ids": True}),
    "completions-ids": (
        "/v1/completions",
        {"model": "tiny-qwen", "prompt": [785, 6722, 315, 9625, 374], "max_tokens": 6,
         "logprobs": 1, "return_token_ids": True},
    ),
    "completions-batch-n2": (
        "/v1/completions",
        {"model": "tiny-qwen", "prompt": [[785, 6722], [9707, 1879, 11]], "n": 2,
         "max_tokens": 5, "return_token_ids": True},
    ),
    "generate": (
        "/inference/v1/generate",
        {"token_ids": [785, 6722, 315], "sampling_params": {"max_tokens": 6, "logprobs": 1},
         "return_token_ids": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(VLLM_CASES))
async def test_vllm_dialects_stream_and_plain_give_identical_bytes_and_equal_records(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, case: str
) -> None:
    _, upstream = fake_vllm
    path, body = VLLM_CASES[case]
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        plain = orjson.loads(await same_bytes(upstream, proxy, path, body, KEY))
        streamed_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        stream_key = {**KEY, "X-Rollout-N": "1"}
        streamed = sse(await same_bytes(upstream, proxy, path, streamed_body, stream_key))
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]
    calls = all_calls(tmp_path)
    by_stream = {c["stream"]: [x for x in calls if x["stream"] == c["stream"]] for c in calls}
    plain_calls, stream_calls = by_stream[False], by_stream[True]
    assert len(plain_calls) == len(stream_calls) == (2 if "batch" in case else 1)
    for a, b in zip(plain_calls, stream_calls, strict=True):
        for field in ("prompt", "outputs", "dialect", "http_status", "error"):
            assert without_call_ids(a[field]) == without_call_ids(b[field]), field
        if "model" in body:
            assert a["model"] == b["model"]
    first = plain_calls[0]
    choices = plain["choices"]
    n = body.get("n", 1)
    assert [o["index"] for o in first["outputs"]] == list(range(n))
    assert first["outputs"][0]["token_ids"] == choices[0]["token_ids"]
    prompt_ids = plain.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
    assert first["prompt"]["token_ids"] == (prompt_ids or body.get("token_ids"))
    if case == "chat-tools":
        message = choices[0]["message"]
        assert first["outputs"][0]["tool_calls"] == message["tool_calls"]
        assert first["outputs"][0]["finish_reason"] == "tool_calls"
        assert len(first["outputs"][0]["logprobs"]) == len(choices[0]["token_ids"])
        assert first["prompt"]["tools"] == TOOLS
    if "batch" in case:
        second = plain_calls[1]
        assert second["prompt"]["token_ids"] == body["prompt"][1]
        assert second["outputs"][1]["token_ids"] == choices[3]["token_ids"]


SGLANG_CASES: dict[str, Json] = {
    "input-ids": {"input_ids": [785, 6722, 315], "sampling_params": {"max_new_tokens": 6},
                  "return_logprob": True, "rid": "traj-7-turn-0"},
    "text": {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}},
    "batch-n2": {"input_ids": [[785, 6722], [9707, 1879]],
                 "sampling_params": {"max_new_tokens": 4, "n": 2}, "rid": ["a", "b"]},
}  # fmt: skip


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("case", list(SGLANG_CASES))
async def test_sglang_generate_stream_and_plain(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path, case: str, incremental: bool
) -> None:
    fake = FakeSGLang(qwen_tokenizer, deterministic=True, incremental_streaming_output=incremental)
    upstream = await start_fake(fake)
    body = SGLANG_CASES[case]
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        plain = orjson.loads(await same_bytes(upstream, proxy, "/generate", body, KEY))
        await same_bytes(
            upstream, proxy, "/generate", {**body, "stream": True}, {**KEY, "X-Rollout-N": "1"}
        )
    items = plain if isinstance(plain, list) else [plain]
    calls = all_calls(tmp_path)
    plain_calls = [c for c in calls if not c["stream"]]
    stream_calls = [c for c in calls if c["stream"]]
    for a, b in zip(plain_calls, stream_calls, strict=True):
        assert a["outputs"] == b["outputs"] and a["prompt"] == b["prompt"]
    outputs = [o for c in plain_calls for o in c["outputs"]]
    assert [o["token_ids"] for o in outputs] == [i["output_ids"] for i in items]
    assert [o["text"] for o in outputs] == [i["text"] for i in items]
    assert [o["finish_reason"] for o in outputs] == [
        i["meta_info"]["finish_reason"]["type"] for i in items
    ]
    if body.get("return_logprob"):
        expected = [t[0] for t in items[0]["meta_info"]["output_token_logprobs"]]
        assert outputs[0]["logprobs"] == expected


async def test_sglang_rid_mapping_groups_turns_into_one_trajectory(
    fake_sglang: tuple[FakeSGLang, str], tmp_path: Path
) -> None:
    _, upstream = fake_sglang
    rule = r"body:rid=/^(?P<trajectory_id>traj-\d+)-turn-\d+$/"
    async with running_proxy([upstream], tmp_path, map=[rule]) as (_, proxy):
        async with aiohttp.ClientSession() as session:
            for traj in range(3):
                for turn in range(2):
                    body = {"input_ids": [1, 2, 3 + turn], "rid": f"traj-{traj}-turn-{turn}",
                            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
                    async with session.post(proxy + "/generate", json=body) as response:
                        assert response.status == 200
    recorded = trajectories(tmp_path)
    assert sorted(t["key"]["trajectory_id"] for t in recorded) == ["traj-0", "traj-1", "traj-2"]
    assert all(len(t["calls"]) == 2 for t in recorded)
    assert recorded[0]["key"]["sources"]["trajectory_id"] == f"map:{rule}"


async def test_sglang_refusals_and_its_crash_are_recorded_as_the_server_gave_them(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    """What SGLang refuses after a stream began is a failed call with its message, not a
    trainer's abort, even when the request could not be parsed; `"text": []` says it held no
    prompt; the crash an empty prompt causes reaches the client as the proxy's 502 and the
    call as a transport error."""
    fake = FakeSGLang(qwen_tokenizer, deterministic=True, context_length=64)
    upstream = await start_fake(fake)
    refused = {"input_ids": list(range(1, 59)), "stream": True, "rid": "near-full"}
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        await same_bytes(upstream, proxy, "/generate", refused, KEY)
        await same_bytes(upstream, proxy, "/generate", {"text": []}, KEY)
        await same_bytes(upstream, proxy, "/generate", {"input_ids": [], "stream": True}, KEY)
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": [[]]}
            async with session.post(proxy + "/generate", json=body, headers=KEY) as response:
                assert response.status == 502
                assert (await response.json())["error"]["type"] == "upstream_reset"
    assert fake.crashed
    near_full, empty_batch, no_ids, crashed = all_calls(tmp_path)
    assert near_full["outputs"][0]["finish_reason"] == "abort"
    assert near_full["error"] == {
        "type": "BadRequestError",
        "message": "Input length (58 tokens) exceeds the maximum allowed length (58 tokens). "
        "Use a shorter input or enable --allow-auto-truncate.",
    }
    assert empty_batch["http_status"] == 200 and empty_batch["outputs"] == []
    assert empty_batch["unparsed"] == "'text' is an empty batch: no prompt to generate from"
    assert no_ids["unparsed"] and no_ids["http_status"] == 200  # refused after the 200:
    assert no_ids["error"] == {"type": "invalid_request_error",
                               "message": "input_ids cannot be empty."}  # fmt: skip
    assert crashed["http_status"] == 502 and crashed["error"]["type"] == "transport"


async def test_sglang_openai_chat_flavour(
    fake_sglang: tuple[FakeSGLang, str], tmp_path: Path
) -> None:
    _, upstream = fake_sglang
    body = {**CHAT, "tools": TOOLS, "return_token_ids": True}
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        reply = orjson.loads(await same_bytes(upstream, proxy, "/v1/chat/completions", body, KEY))
    [call] = all_calls(tmp_path)
    [choice] = reply["choices"]
    assert call["prompt"]["token_ids"] == choice["prompt_token_ids"]
    assert call["outputs"][0]["token_ids"] == choice["response_token_ids"]
    assert call["request_id"] == reply["id"]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_client_chat_and_completions(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, stream: bool
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="sk-test")
        direct = AsyncOpenAI(base_url=upstream + "/v1", api_key="sk-test")
        results = []
        for each in (direct, client):
            chat = await each.chat.completions.create(
                model="tiny-qwen", messages=CHAT["messages"], tools=TOOLS, stream=stream,  # type: ignore[arg-type]
                extra_headers={"X-Rollout-Trajectory-Id": "openai-1"},
            )  # fmt: skip
            text = await each.completions.create(
                model="tiny-qwen", prompt="Once upon a time", max_tokens=5, stream=stream,
                extra_headers={"X-Rollout-Trajectory-Id": "openai-1"},
            )  # fmt: skip
            if stream:
                chat = [c.model_dump() async for c in chat]  # type: ignore[union-attr]
                text = [c.model_dump() async for c in text]  # type: ignore[union-attr]
            else:
                chat, text = chat.model_dump(), text.model_dump()  # type: ignore[union-attr]
            results.append((chat, text))
        await client.close()
        await direct.close()
    assert results[0] == results[1]
    [trajectory] = trajectories(tmp_path)
    assert [c["dialect"] for c in trajectory["calls"]] == ["openai.chat", "openai.completions"]
    assert trajectory["calls"][1]["prompt"]["text"] == "Once upon a time"


async def test_keepalive_comments_and_mid_stream_error(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    fake = FakeVLLM(
        qwen_tokenizer, deterministic=True, keepalive_comments=True, error_after_chunks=2
    )
    upstream = await start_fake(fake)
    body = {**CHAT, "stream": True, "max_tokens": 20}
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        raw = await same_bytes(upstream, proxy, "/v1/chat/completions", body, KEY)
    assert b": keep-alive\n\n" in raw and raw.endswith(b"data: [DONE]\n\n")
    [call] = all_calls(tmp_path)
    error_event = next(e for e in sse(raw) if "error" in e)
    assert call["error"]["message"] == error_event["error"]["message"]
    assert call["http_status"] == 200


async def test_client_disconnect_aborts_the_generation_upstream(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    fake = FakeVLLM(qwen_tokenizer, token_delay=0.05)
    upstream = await start_fake(fake)
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        session = aiohttp.ClientSession()
        response = await session.post(
            proxy + "/v1/completions",
            json={"model": "tiny-qwen", "prompt": [1, 2, 3], "max_tokens": 500, "stream": True},
        )
        await response.content.readuntil(b"\n\n")
        response.close()
        await session.close()
        aborted = await fake.wait_aborted(1, timeout=20)
    assert len(aborted) == 1
    [call] = all_calls(tmp_path)
    assert call["error"]["message"] == "client disconnected"


async def test_weight_updates_are_step_events_and_versions_reach_the_calls(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    upstream = await start_fake(FakeSGLang(qwen_tokenizer, deterministic=True))
    headers = {"X-Rollout-Experiment": "exp"}
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        async with aiohttp.ClientSession(headers=headers) as session:
            for path, body in (
                ("/pause_generation", {"mode": "abort"}),
                ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bf16"],
                 "shapes": [[2]], "group_name": "g", "weight_version": "v7"}),
                ("/continue_generation", {}),
            ):  # fmt: skip
                async with session.post(proxy + path, json=body) as response:
                    assert response.status == 200
            async with session.post(
                proxy + "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                headers={"X-Rollout-Trajectory-Id": "after-update"},
            ) as response:
                assert response.status == 200
    recorded = events(tmp_path)
    assert [e["event"] for e in recorded] == ["pause", "weight_update", "resume"]
    assert recorded[1]["weight_version"] == "v7" and recorded[1]["experiment"] == "exp"
    [trajectory] = trajectories(tmp_path)
    assert trajectory["weight_versions"] == ["v7"]


async def test_vllm_weight_version_spans_reach_every_dialect(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    upstream = await start_fake(FakeVLLM(qwen_tokenizer, deterministic=True))
    requests = [
        ("/v1/chat/completions", {**CHAT, "return_weight_versions": True}),
        ("/v1/completions", {"model": "tiny-qwen", "prompt": [1, 2], "max_tokens": 3,
                             "return_weight_versions": True}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}),
    ]  # fmt: skip
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        async with aiohttp.ClientSession() as session:
            for path in ("/pause", "/start_weight_update"):
                async with session.post(proxy + path) as response:
                    assert response.status == 200
            async with session.post(
                proxy + "/finish_weight_update", json={"weight_version": "v3"}
            ) as response:
                assert response.status == 200
            async with session.post(proxy + "/resume") as response:
                assert response.status == 200
            for stream in (False, True):
                for i, (path, body) in enumerate(requests):
                    async with session.post(
                        proxy + path,
                        json={**body, "stream": stream},
                        headers={"X-Rollout-Trajectory-Id": f"{path}-{stream}-{i}"},
                    ) as response:
                        assert response.status == 200
                        await response.read()
    calls = all_calls(tmp_path)
    assert len(calls) == 6
    assert {c["weight_version"] for c in calls} == {"v3"}
    finish = [e for e in events(tmp_path) if e["event"] == "weight_update_finish"]
    assert finish[0]["weight_version"] == "v3"


async def test_path_prefix_and_baggage_through_the_proxy(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    fake = FakeVLLM(qwen_tokenizer, deterministic=True)
    upstream = await start_fake(fake)
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        # A client that can only set a base URL.
        client = AsyncOpenAI(
            base_url=proxy + "/rollout/experiment=grpo/step=5/sample_index=2/n=1/v1", api_key="x"
        )
        await client.chat.completions.create(model="tiny-qwen", messages=CHAT["messages"])  # type: ignore[arg-type]
        await client.close()
        # A client that propagates W3C baggage.
        async with aiohttp.ClientSession() as session:
            baggage = "rollout.experiment=grpo,rollout.step=5,rollout.sample_index=3,rollout.n=0"
            async with session.post(
                proxy + "/v1/completions",
                json={"model": "tiny-qwen", "prompt": [1, 2, 3], "max_tokens": 2},
                headers={"baggage": baggage},
            ) as response:
                assert response.status == 200
    assert [r.path for r in fake.requests] == ["/v1/chat/completions", "/v1/completions"]
    by_sample = {t["key"]["sample_index"]: t for t in trajectories(tmp_path)}
    path_key, baggage_key = by_sample[2]["key"], by_sample[3]["key"]
    assert (path_key["experiment"], path_key["step"], path_key["rollout_n"]) == ("grpo", 5, 1)
    assert path_key["sources"]["step"] == "path"
    assert (baggage_key["step"], baggage_key["rollout_n"]) == (5, 0)
    assert baggage_key["sources"]["step"] == "baggage:rollout.step"


@pytest.mark.parametrize(
    ("value", "is_token_ids"),
    [
        ([3, 1, 4], True),
        ([], True),
        ([1, 2.0], False),
        ([1.0], False),
        ([1, "2"], False),
        ([1, None], False),
        ([True, 2], False),
        ([False], False),
        ([[1, 2]], False),
        ([{"id": 1}], False),
        ("1 2", False),
        (None, False),
    ],
)
def test_only_lists_of_integers_are_taken_as_token_ids(value: Any, is_token_ids: bool) -> None:
    assert as_int_list(value) is (value if is_token_ids else None)


@pytest.mark.parametrize(
    ("logprobs", "expected"),
    [
        ({"token_logprobs": [-0.5, -1.25]}, [-0.5, -1.25]),
        ({"token_logprobs": [0, -1.5]}, [0.0, -1.5]),  # an int written for 0: a float
        ({"token_logprobs": [-0.5, None]}, [-0.5, "nan"]),  # a gap in a completion: NaN
        ({"content": [{"logprob": -0.5}, {"logprob": None}]}, None),  # chat: no gaps
        ({"token_logprobs": [-0.5, True]}, None),
        ({"token_logprobs": [-0.5, "-1.0"]}, None),
        ({"content": [{"logprob": -2}, {"logprob": -0.25}]}, [-2.0, -0.25]),
        ({"token_logprobs": []}, []),
    ],
)
def test_chosen_logprobs_are_floats_or_nothing(logprobs: dict[str, Any], expected: Any) -> None:
    from trace_proxy.capture.dialects.common import chosen_logprobs

    got = chosen_logprobs(logprobs)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert [type(value) for value in got] == [float] * len(expected)
    assert [("nan" if value != value else value) for value in got] == expected
