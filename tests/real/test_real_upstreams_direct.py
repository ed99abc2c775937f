"""Direct smoke tests of the real servers, without the proxy in between.

They pin down what the proxy's own real-upstream tests rely on: vLLM takes token-id prompts and
returns token ids (plain and streamed), logprobs and token-in/token-out generation; its ids decode
with the fixture's tokenizer to exactly its text and match the ChatML prompt we render ourselves;
`transformers serve` works with the real `openai` client. When one of these breaks, a proxy test
failure would otherwise be misread as a proxy bug.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

if TYPE_CHECKING:
    from .conftest import RealServer

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Say hi"}]
CHATML_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
PROMPT_TEXT = "The capital of France is"
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}

Json = dict[str, Any]


@pytest.fixture(scope="module")
def tokenizer(real_vllm: RealServer) -> Any:
    """The tokenizer saved with the tiny model (the real Qwen one), loaded offline."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(real_vllm.model_dir))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.fixture
def prompt_ids(tokenizer: Any) -> list[int]:
    ids: list[int] = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return ids


async def _post(http: aiohttp.ClientSession, url: str, body: Json) -> Json:
    async with http.post(url, json=body) as response:
        text = await response.text()
        assert response.status == 200, text
        result: Json = orjson.loads(text)
        return result


async def _post_stream(http: aiohttp.ClientSession, url: str, body: Json) -> list[Json]:
    """The JSON payloads of an SSE response, after checking it ends with `data: [DONE]`."""
    async with http.post(url, json={**body, "stream": True}) as response:
        text = await response.text()
        assert response.status == 200, text
    events = [event for event in text.split("\n\n") if event.strip()]
    assert all(event.startswith("data: ") for event in events), text
    assert events[-1] == "data: [DONE]"
    return [orjson.loads(event.removeprefix("data: ")) for event in events[:-1]]


def _assert_greedy_logprobs(chosen: list[float], best: list[float]) -> None:
    """Under temperature 0 the sampled token is the top-1, so both logprobs agree."""
    assert chosen == pytest.approx(best)
    assert all(logprob <= 0 for logprob in chosen)


def test_tokenizer_is_the_real_qwen_one(tokenizer: Any) -> None:
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645


async def test_vllm_chat_prompt_ids_are_our_chatml_and_output_ids_decode_to_text(
    real_vllm: RealServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    body = {"model": real_vllm.model, "messages": MESSAGES, **GREEDY}
    body |= {"return_token_ids": True, "logprobs": True, "top_logprobs": 1}
    reply = await _post(http, f"{real_vllm.base_url}/v1/chat/completions", body)

    ours = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert reply["prompt_token_ids"] == ours["input_ids"]
    assert tokenizer.decode(reply["prompt_token_ids"]) == CHATML_PROMPT
    choice = reply["choices"][0]
    token_ids = choice["token_ids"]
    assert 0 < len(token_ids) == reply["usage"]["completion_tokens"] <= MAX_TOKENS
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(token_ids)
    _assert_greedy_logprobs(
        [c["logprob"] for c in content], [c["top_logprobs"][0]["logprob"] for c in content]
    )


async def test_vllm_chat_stream_has_prompt_ids_first_then_token_ids_per_chunk(
    real_vllm: RealServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    url = f"{real_vllm.base_url}/v1/chat/completions"
    body = {"model": real_vllm.model, "messages": MESSAGES, **GREEDY, "return_token_ids": True}
    whole = await _post(http, url, body)
    chunks = await _post_stream(http, url, {**body, "stream_options": {"include_usage": True}})

    ours = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert chunks[0]["prompt_token_ids"] == ours["input_ids"]
    assert all(chunk.get("prompt_token_ids") is None for chunk in chunks[1:])
    *deltas, usage = chunks
    assert usage["choices"] == []
    with_tokens = [c["choices"][0] for c in deltas if c["choices"][0].get("token_ids")]
    assert all(len(choice["token_ids"]) >= 1 for choice in with_tokens)
    streamed_ids = [i for choice in with_tokens for i in choice["token_ids"]]
    streamed_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in deltas)
    assert streamed_ids == whole["choices"][0]["token_ids"]
    assert streamed_text == whole["choices"][0]["message"]["content"]
    assert usage["usage"]["completion_tokens"] == len(streamed_ids)
    assert tokenizer.decode(streamed_ids, skip_special_tokens=True) == streamed_text


async def test_vllm_completion_of_token_id_prompt_returns_ids_and_logprobs(
    real_vllm: RealServer, http: aiohttp.ClientSession, tokenizer: Any, prompt_ids: list[int]
) -> None:
    body = {"model": real_vllm.model, "prompt": prompt_ids, **GREEDY}
    body |= {"return_token_ids": True, "logprobs": 1}
    reply = await _post(http, f"{real_vllm.base_url}/v1/completions", body)

    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert 0 < len(choice["token_ids"]) <= MAX_TOKENS
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(choice["token_ids"])
    _assert_greedy_logprobs(
        logprobs["token_logprobs"], [max(top.values()) for top in logprobs["top_logprobs"]]
    )


async def test_vllm_completion_stream_has_prompt_ids_first_then_token_ids_per_chunk(
    real_vllm: RealServer, http: aiohttp.ClientSession, prompt_ids: list[int]
) -> None:
    url = f"{real_vllm.base_url}/v1/completions"
    body = {"model": real_vllm.model, "prompt": prompt_ids, **GREEDY, "return_token_ids": True}
    whole = (await _post(http, url, body))["choices"][0]
    chunks = await _post_stream(http, url, {**body, "stream_options": {"include_usage": True}})

    *deltas, usage = chunks
    choices = [chunk["choices"][0] for chunk in deltas]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert all(choice["prompt_token_ids"] is None for choice in choices[1:])
    assert all(len(choice["token_ids"]) >= 1 for choice in choices)
    assert [i for choice in choices for i in choice["token_ids"]] == whole["token_ids"]
    assert "".join(choice["text"] for choice in choices) == whole["text"]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(whole["token_ids"])


async def test_vllm_generate_is_token_in_token_out(
    real_vllm: RealServer, http: aiohttp.ClientSession, prompt_ids: list[int]
) -> None:
    completion = await _post(
        http,
        f"{real_vllm.base_url}/v1/completions",
        {"model": real_vllm.model, "prompt": prompt_ids, **GREEDY, "return_token_ids": True},
    )
    body = {
        "model": real_vllm.model,
        "token_ids": prompt_ids,
        "sampling_params": {**GREEDY, "logprobs": 1},
        "return_token_ids": True,  # without it, prompt_token_ids comes back null
    }
    reply = await _post(http, f"{real_vllm.base_url}/inference/v1/generate", body)

    assert reply["prompt_token_ids"] == prompt_ids
    choice = reply["choices"][0]
    assert choice["token_ids"] == completion["choices"][0]["token_ids"]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    _assert_greedy_logprobs(
        [c["logprob"] for c in content], [c["top_logprobs"][0]["logprob"] for c in content]
    )


async def test_vllm_generate_stream_has_prompt_ids_first_then_token_ids_per_chunk(
    real_vllm: RealServer, http: aiohttp.ClientSession, prompt_ids: list[int]
) -> None:
    url = f"{real_vllm.base_url}/inference/v1/generate"
    body = {"token_ids": prompt_ids, "sampling_params": GREEDY, "return_token_ids": True}
    whole = await _post(http, url, body)
    chunks = await _post_stream(http, url, {**body, "stream_options": {"include_usage": True}})

    *deltas, usage = chunks
    assert deltas[0]["prompt_token_ids"] == prompt_ids
    assert all(chunk.get("prompt_token_ids") is None for chunk in deltas[1:])
    streamed = [i for chunk in deltas for i in chunk["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(streamed)


def _openai(server: RealServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


async def test_transformers_serve_chat_with_openai_client(transformers_serve: RealServer) -> None:
    async with _openai(transformers_serve) as client:
        reply = await client.chat.completions.create(
            model=transformers_serve.model,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= MAX_TOKENS


async def test_transformers_serve_stream_with_openai_client_matches_whole_reply(
    transformers_serve: RealServer,
) -> None:
    request: Json = {
        "model": transformers_serve.model,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    async with _openai(transformers_serve) as client:
        whole = await client.chat.completions.create(**request)
        stream = await client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_both_servers_run_the_same_model(
    real_vllm: RealServer, transformers_serve: RealServer, http: aiohttp.ClientSession
) -> None:
    """Same weights and template, so greedy text agrees; proves both fixtures share model_dir."""
    vllm = await _post(
        http,
        f"{real_vllm.base_url}/v1/chat/completions",
        {"model": real_vllm.model, "messages": MESSAGES, **GREEDY},
    )
    async with _openai(transformers_serve) as client:
        serve = await client.chat.completions.create(
            model=transformers_serve.model,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
    assert real_vllm.model_dir == transformers_serve.model_dir
    assert serve.choices[0].message.content == vllm["choices"][0]["message"]["content"]
