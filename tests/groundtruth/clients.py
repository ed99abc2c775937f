"""One generate request per dialect, sent and read the way the RL frameworks do it.

Bodies follow the frameworks' own payloads (reference rl-frameworks.md): slime/AReaL's SGLang
`/generate` with `input_ids`, AReaL's vLLM `/v1/completions` (`return_tokens_as_token_ids`,
no `return_token_ids`), SkyRL's `/inference/v1/generate`, and OpenAI-style chat for agent
frameworks (rllm: `logprobs` + `return_token_ids`). Streams are read to the end and folded
into the same `Reply` a plain response gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

JSON = dict[str, Any]
MODEL = "tiny-qwen"


class GenerateFailed(RuntimeError):
    """The server (or the proxy) did not answer a generate with a usable 200."""


@dataclass
class Reply:
    request_id: str
    finish_reason: str | None
    token_ids: list[int] | None = None  # generated ids (token dialects)
    content: str | None = None  # chat
    tool_calls: list[JSON] = field(default_factory=list)  # chat


@dataclass(frozen=True)
class Sampling:
    """What varies between the rollouts of a group: the seed; validation is greedy."""

    max_tokens: int
    temperature: float
    seed: int | None


async def post(
    session: aiohttp.ClientSession, url: str, body: JSON, headers: dict[str, str]
) -> bytes:
    async with session.post(url, json=body, headers=headers) as response:
        payload = await response.read()
        if response.status != 200:
            raise GenerateFailed(f"{url}: HTTP {response.status}: {payload[:300]!r}")
        return payload


def sse_events(payload: bytes) -> list[JSON]:
    """The JSON `data:` events of a stream (keep-alive comments and [DONE] skipped)."""
    events = []
    for block in payload.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                event = orjson.loads(line[6:])
                if "error" in event:
                    raise GenerateFailed(f"stream error: {event['error']}")
                events.append(event)
    return events


# --- chat (vLLM and SGLang) ------------------------------------------------------------------


def chat_body(
    backend: str, messages: list[JSON], tools: list[JSON], s: Sampling, stream: bool
) -> JSON:
    body: JSON = {
        "model": MODEL,
        "messages": messages,
        "tools": tools,
        "temperature": s.temperature,
    }
    body["max_tokens" if backend == "sglang" else "max_completion_tokens"] = s.max_tokens
    if s.seed is not None:
        body["seed"] = s.seed
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    elif backend == "vllm":
        body.update(logprobs=True, return_token_ids=True)
    else:
        body["return_token_ids"] = True
    return body


def read_chat(payload: bytes, stream: bool) -> Reply:
    if stream:
        return _read_chat_stream(payload)
    body = orjson.loads(payload)
    choice = body["choices"][0]
    message = choice["message"]
    calls = [_plain_call(c) for c in message.get("tool_calls") or []]
    return Reply(body["id"], choice["finish_reason"], None, message.get("content"), calls)


def _read_chat_stream(payload: bytes) -> Reply:
    """Content deltas joined; tool-call fragments folded by index, as OpenAI clients do."""
    text: list[str] = []
    calls: dict[int, JSON] = {}
    request_id, finish = "", None
    for event in sse_events(payload):
        request_id = request_id or event.get("id", "")
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            for fragment in delta.get("tool_calls") or []:
                _fold_tool_delta(calls, fragment)
            finish = choice.get("finish_reason") or finish
    content = "".join(text) or None
    return Reply(request_id, finish, None, content, [calls[i] for i in sorted(calls)])


def _plain_call(call: JSON) -> JSON:
    """A tool call as a client sends it back: id, type, function{name, arguments}."""
    fn = call.get("function") or {}
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn["arguments"]},
    }


def _fold_tool_delta(calls: dict[int, JSON], fragment: JSON) -> None:
    call = calls.setdefault(
        int(fragment.get("index") or 0),
        {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
    )
    if fragment.get("id"):
        call["id"] = fragment["id"]
    fn = fragment.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    call["function"]["arguments"] += fn.get("arguments") or ""


# --- token-in / token-out ---------------------------------------------------------------------


def completions_body(
    ids: list[int], s: Sampling, stream: bool, areal: bool, rid: str | None
) -> JSON:
    body: JSON = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if areal:  # AReaL's payload: ids only through the logprob tokens
        body.update(logprobs=0, return_tokens_as_token_ids=True)
    else:
        body.update(logprobs=1, return_token_ids=True, return_weight_versions=True)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if rid is not None:
        body["request_id"] = rid
    return body


def text_completions_body(prompts: list[list[int]], s: Sampling) -> JSON:
    """skyrl-train's remote engine: a batch of id lists, text back (no token ids asked for);
    the agent re-tokenizes each reply for its next prompt."""
    body: JSON = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "skip_special_tokens": False,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def read_text_completions(payload: bytes) -> list[Reply]:
    """One reply per prompt, in choice order; `content` is the text."""
    body = orjson.loads(payload)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    return [Reply(body["id"], c["finish_reason"], None, c["text"]) for c in choices]


def read_completions(payload: bytes, stream: bool, areal: bool) -> Reply:
    if not stream:
        body = orjson.loads(payload)
        choice = body["choices"][0]
        if areal:
            ids = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
        else:
            ids = list(choice["token_ids"])
        return Reply(body["id"], choice["finish_reason"], ids)
    return _read_token_deltas(payload, "id")


def _read_token_deltas(payload: bytes, id_field: str) -> Reply:
    """vLLM token streams: `choices[0].token_ids` deltas, the finish reason at the end."""
    ids: list[int] = []
    request_id, finish = "", None
    for event in sse_events(payload):
        request_id = request_id or event.get(id_field, "")
        for choice in event.get("choices") or []:
            ids.extend(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
    return Reply(request_id, finish, ids)


def vllm_generate_body(ids: list[int], s: Sampling, stream: bool, rid: str | None) -> JSON:
    params: JSON = {"max_tokens": s.max_tokens, "temperature": s.temperature, "logprobs": 1}
    if s.seed is not None:
        params["seed"] = s.seed
    body: JSON = {"model": MODEL, "token_ids": ids, "sampling_params": params}
    if stream:
        body["stream"] = True
    if rid is not None:
        body["request_id"] = rid
    return body


def read_vllm_generate(payload: bytes, stream: bool) -> Reply:
    if not stream:
        body = orjson.loads(payload)
        choice = body["choices"][0]
        return Reply(body["request_id"], choice["finish_reason"], list(choice["token_ids"]))
    return _read_token_deltas(payload, "request_id")


def sglang_generate_body(ids: list[int], s: Sampling, stream: bool, rid: str | None) -> JSON:
    params: JSON = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    body: JSON = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
    if stream:
        body["stream"] = True
    if rid is not None:
        body["rid"] = rid
    return body


def read_sglang_generate(payload: bytes, stream: bool) -> Reply:
    """Cumulative streams (SGLang's default): the last chunk holds every id."""
    final = sse_events(payload)[-1] if stream else orjson.loads(payload)
    meta = final["meta_info"]
    finish = meta.get("finish_reason") or {}
    return Reply(meta["id"], finish.get("type"), list(final["output_ids"]))
