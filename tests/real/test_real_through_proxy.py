"""The proxy in front of REAL servers: answers identical to direct ones, and exact records.

Two calls to a real server differ in response ids and timestamps; everything else (status,
headers, every other byte of the body, every streamed event) must be the same through the proxy
as direct. Greedy decoding makes the generated tokens themselves reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from support.proxies import running_proxy, trajectories

from trace_proxy.trajectories.prompts import expand_prompts

if TYPE_CHECKING:
    from .conftest import RealServer

Json = dict[str, Any]
VOLATILE_KEYS = {"id", "created", "request_id"}
VOLATILE_HEADERS = {"date", "content-length", "x-request-id"}
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT_IDS = [785, 6722, 315, 9625, 374]  # "The capital of France is"


def normalized(value: Any) -> Any:
    """The value with per-call ids and timestamps removed."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def stable_headers(response: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [
        (k.lower(), v) for k, v in response.headers.items() if k.lower() not in VOLATILE_HEADERS
    ]


def events_of(body: bytes) -> list[Any]:
    """SSE events in order; `[DONE]` kept as a marker so its presence is compared too."""
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        yield session


async def direct_and_proxied(
    http: aiohttp.ClientSession, server: str, proxy: str, path: str, body: Json, headers: Json
) -> tuple[bytes, bytes]:
    """Send the same request direct and through the proxy; assert status and headers agree."""
    async with http.post(server + path, json=body) as direct:
        direct_body = await direct.read()
        direct_status, direct_headers = direct.status, stable_headers(direct)
    async with http.post(proxy + path, json=body, headers=headers) as proxied:
        proxied_body = await proxied.read()
        assert proxied.status == direct_status == 200, proxied_body[:500]
        assert stable_headers(proxied) == direct_headers
    return direct_body, proxied_body


CASES = {
    "chat": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True,
         "top_logprobs": 2, "return_token_ids": True},
    ),
    "completions": (
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 1,
         "return_token_ids": True},
    ),
    "generate": (
        "/inference/v1/generate",
        {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 12, "temperature": 0,
         "logprobs": 1}, "return_token_ids": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", list(CASES))
async def test_vllm_passthrough_and_record(
    real_vllm: RealServer, http: aiohttp.ClientSession, tmp_path: Path, case: str, stream: bool
) -> None:
    path, body = CASES[case]
    body = {**body, "model": real_vllm.model}
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "0", "Authorization": "Bearer x"}
    async with running_proxy([real_vllm.base_url], tmp_path) as (_, proxy):
        direct, proxied = await direct_and_proxied(
            http, real_vllm.base_url, proxy, path, body, headers
        )
    if stream:
        direct_events, proxied_events = events_of(direct), events_of(proxied)
        assert proxied_events[-1] == "[DONE]"
        assert normalized(proxied_events) == normalized(direct_events)
        reply = _merge_stream(proxied_events)
    else:
        assert normalized(orjson.loads(proxied)) == normalized(orjson.loads(direct))
        reply = _reply_of(orjson.loads(proxied))

    [trajectory] = trajectories(tmp_path)
    [call] = trajectory["calls"]
    assert call["http_status"] == 200 and call["stream"] is stream and call["error"] is None
    assert call["prompt"]["token_ids"] == reply["prompt_token_ids"]
    [output] = call["outputs"]
    assert output["token_ids"] == reply["token_ids"]
    assert output["finish_reason"] == reply["finish_reason"]
    assert len(output["logprobs"]) == len(reply["token_ids"])
    if case != "generate":
        assert output["text"] == reply["text"]
    assert call["request_headers"]["authorization"] == "[redacted]"


def _reply_of(body: Json) -> Json:
    [choice] = body["choices"]
    return {
        "prompt_token_ids": body.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        "token_ids": choice["token_ids"],
        "text": (choice.get("message") or {}).get("content") or choice.get("text"),
        "finish_reason": choice["finish_reason"],
    }


def _merge_stream(events: list[Any]) -> Json:
    """The reply a test expects the record to hold, rebuilt from the raw events."""
    merged: Json = {"token_ids": [], "text": "", "prompt_token_ids": None, "finish_reason": None}
    for event in events:
        if event == "[DONE]":
            continue
        if event.get("prompt_token_ids") is not None:
            merged["prompt_token_ids"] = event["prompt_token_ids"]
        for choice in event.get("choices") or []:
            if merged["prompt_token_ids"] is None and choice.get("prompt_token_ids"):
                merged["prompt_token_ids"] = choice["prompt_token_ids"]
            merged["token_ids"] += choice.get("token_ids") or []
            merged["text"] += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            merged["finish_reason"] = choice.get("finish_reason") or merged["finish_reason"]
    return merged


async def test_streamed_and_plain_calls_give_the_same_record(
    real_vllm: RealServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    body = {"model": real_vllm.model, **CASES["chat"][1]}
    async with running_proxy([real_vllm.base_url], tmp_path) as (_, proxy):
        for sample, stream in enumerate((False, True)):
            headers = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": str(sample)}
            async with http.post(
                proxy + "/v1/chat/completions", json={**body, "stream": stream}, headers=headers
            ) as response:
                await response.read()
    plain, streamed = (t["calls"][0] for t in sorted(trajectories(tmp_path), key=_sample))
    for field in ("prompt", "outputs", "model", "sampling", "dialect", "http_status"):
        assert normalized(streamed[field]) == normalized(plain[field]), field


def _sample(trajectory: Json) -> int:
    return int(trajectory["key"]["sample_index"])


async def test_multi_turn_chat_shares_prompt_prefixes_exactly(
    real_vllm: RealServer, tmp_path: Path
) -> None:
    """The OpenAI SDK sends each reply back as `choice.message` (vLLM's message, with the
    SDK's members and nulls): the store keeps each reply once, and gives back every request."""
    messages: list[Any] = [{"role": "user", "content": "Count to three."}]
    full_prompts: list[list[int]] = []
    sent: list[Json] = []

    async def keep(request: httpx.Request) -> None:
        sent.append(orjson.loads(request.content))

    headers = {"X-Rollout-Trajectory-Id": "conversation-1"}
    async with running_proxy([real_vllm.base_url], tmp_path) as (_, proxy):
        http = httpx.AsyncClient(event_hooks={"request": [keep]}, timeout=180)
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="none", http_client=http)
        for turn in range(3):
            if turn == 2:
                headers["X-Rollout-Done"] = "true"
            reply = await client.chat.completions.create(
                model=real_vllm.model, messages=messages, max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True}, extra_headers=headers,
            )  # fmt: skip
            full_prompts.append((reply.model_extra or {})["prompt_token_ids"])
            messages = [*messages, reply.choices[0].message,
                        {"role": "user", "content": f"And then {turn}?"}]  # fmt: skip
        await client.close()
    [trajectory] = trajectories(tmp_path)
    assert trajectory["close_reason"] == "done"
    calls = trajectory["calls"]
    assert [c["prompt"]["prefix_call"] for c in calls] == [None, 0, 1]
    stored_ids = sum(len(c["prompt"]["token_ids"]) for c in calls)
    assert stored_ids < sum(map(len, full_prompts))
    expanded = expand_prompts(trajectory)
    assert [p["token_ids"] for p in expanded] == full_prompts
    assert [p["messages"] for p in expanded] == [body["messages"] for body in sent]
    for before, body, call in zip(sent, sent[1:], calls[1:], strict=False):
        prompt = call["prompt"]  # the reply sent back is not stored again
        assert prompt["prefix_len"]["messages"] == len(before["messages"]) + 1
        assert prompt["messages"] == body["messages"][-1:]
        assert prompt["prefix_reply"]["from_output"] == ["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_transformers_serve_with_the_openai_client(
    transformers_serve: RealServer, tmp_path: Path, stream: bool
) -> None:
    kwargs: Json = {"model": transformers_serve.model, "messages": MESSAGES, "max_tokens": 10,
                    "temperature": 0}  # fmt: skip
    direct_client = AsyncOpenAI(base_url=transformers_serve.base_url + "/v1", api_key="x")
    async with running_proxy([transformers_serve.base_url], tmp_path) as (_, proxy):
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="sk-never-recorded")
        texts = []
        for each in (direct_client, client):
            if stream:
                chunks = await each.chat.completions.create(stream=True, **kwargs)
                texts.append("".join([c.choices[0].delta.content or "" async for c in chunks
                                      if c.choices]))  # fmt: skip
            else:
                reply = await each.chat.completions.create(**kwargs)
                texts.append(reply.choices[0].message.content)
        await client.close()
    await direct_client.close()
    assert texts[0] == texts[1] and texts[1]
    [trajectory] = trajectories(tmp_path)
    [call] = trajectory["calls"]
    assert call["prompt"]["messages"] == MESSAGES
    assert call["outputs"][0]["text"] == texts[1]
    assert b"sk-never-recorded" not in b"".join(p.read_bytes() for p in tmp_path.rglob("*.jsonl"))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_token2text_matches_vllms_own_text(
    real_vllm: RealServer, http: aiohttp.ClientSession, tmp_path: Path, stream: bool
) -> None:
    """The tokenizer is found by asking vLLM (`/v1/models` names the model directory); the
    decoded response must be exactly the text vLLM returned for the same ids."""
    replies: dict[str, Json] = {}
    settings = {"token2text": True, "skip_special_tokens": True}
    async with running_proxy([real_vllm.base_url], tmp_path, **settings) as (service, proxy):
        assert service.tokenizer_discovery is not None
        await asyncio.wait_for(service.tokenizer_discovery, 120)
        for sample, (path, body) in enumerate([CASES["chat"], CASES["completions"]]):
            request = {**body, "model": real_vllm.model, "stream": stream, "max_tokens": 16}
            headers = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": str(sample)}
            async with http.post(proxy + path, json=request, headers=headers) as response:
                raw = await response.read()
            replies[path] = (
                _merge_stream(events_of(raw)) if stream else _reply_of(orjson.loads(raw))
            )
    recorded = {t["calls"][0]["route"]: t["calls"][0] for t in trajectories(tmp_path)}
    assert set(recorded) == set(replies) == {"/v1/chat/completions", "/v1/completions"}
    for route, call in recorded.items():
        assert call["outputs"][0]["token_ids"] == replies[route]["token_ids"]
        assert call["outputs"][0]["response_text"] == replies[route]["text"]
        assert call["prompt_text"]
