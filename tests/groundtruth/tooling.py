"""The agent's tools: schemas, a deterministic executor (with failures), and the Hermes markup.

The agent side is written the way verl's ToolAgentLoop does it, independently of the proxy:
tool calls are found with the `<tool_call>(.*?)</tool_call>` regex and `json.loads`, a failing
tool returns the text "Error when executing tool: ...", and results go back into a token prompt
as the chat template renders `role: tool` messages.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

ERROR_PREFIX = "Error when executing tool: "
IM_END = "<|im_end|>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _function(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS: list[dict[str, Any]] = [
    _function(
        "search",
        {"query": {"type": "string"}, "top_k": {"type": "integer"}},
        ["query", "top_k"],
    ),
    _function(
        "get_weather",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    _function("python", {"code": {"type": "string"}}, ["code"]),
    _function("calculator", {"expression": {"type": "string"}}, ["expression"]),
    _function(
        "lookup",
        {"entity": {"type": "string"}, "fields": {"type": "array", "items": {"type": "string"}}},
        ["entity", "fields"],
    ),
]


@dataclass(frozen=True)
class ToolRequest:
    """One tool call as the agent parsed it; `call_id` only on chat dialects."""

    name: str
    arguments: str  # JSON text as the model or server wrote it
    call_id: str | None = None


def canonical(arguments: Any) -> str:
    """Arguments compared by value: spacing and key order are the writer's business."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _digest(*parts: str) -> int:
    return int.from_bytes(
        hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest(), "little"
    )


def execute(name: str, arguments: str) -> str:
    """The tool's result text; about one call in six fails, as sandboxes and APIs do."""
    key = canonical(arguments)
    h = _digest(name, key)
    if h % 6 == 0:
        reason = ("TimeoutError: sandbox did not answer in 30s", "ValueError: bad argument")[h % 2]
        return f"{ERROR_PREFIX}{reason}"
    try:
        args = json.loads(arguments)
    except ValueError:
        return f"{ERROR_PREFIX}JSONDecodeError: arguments are not JSON"
    if name == "search":
        hits = [f"{i + 1}. {args.get('query', '')} - result {h % 97 + i}" for i in range(3)]
        return "\n".join(hits)
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "temp": h % 35, "sky": "clear"})
    if name == "python":
        return f"stdout:\nsum {h % 1000}\nexit_code: 0"
    if name == "calculator":
        return str(h % 100_000)
    return json.dumps({"entity": args.get("entity"), "summary": "Zürich — 1848", "n": h % 50})


def parse_tool_calls(text: str) -> list[ToolRequest]:
    """verl's Hermes parsing of a decoded response: every closed block with valid JSON."""
    found = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        found.append(ToolRequest(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return found


def tool_results_suffix(results: list[str], response_ended: bool) -> str:
    """What a token agent appends after a response: the tool turn and a new generation prompt,
    as the ChatML/Hermes template renders consecutive `role: tool` messages."""
    blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    head = "\n" if response_ended else f"{IM_END}\n"
    return f"{head}<|im_start|>user{blocks}{IM_END}\n<|im_start|>assistant\n"


async def chat_tool_rollout(
    session: aiohttp.ClientSession, proxy: str, messages: list[dict[str, Any]], max_turns: int = 6
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """An OpenAI-client agent: chat with TOOLS, run each requested tool, send its result back,
    until an answer without tool calls. Returns the messages of each request as sent, and each
    reply; `messages` ends as the whole conversation before the last reply."""
    asked: list[list[dict[str, Any]]] = []
    replies: list[dict[str, Any]] = []
    for _ in range(max_turns):
        asked.append(list(messages))
        body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS}
        async with session.post(proxy + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            reply = (await response.json())["choices"][0]["message"]
        replies.append(reply)
        if not reply.get("tool_calls"):
            break
        messages.append(reply)
        messages += [
            {"role": "tool", "tool_call_id": c["id"],
             "content": execute(c["function"]["name"], c["function"]["arguments"])}
            for c in reply["tool_calls"]
        ]  # fmt: skip
    return asked, replies
