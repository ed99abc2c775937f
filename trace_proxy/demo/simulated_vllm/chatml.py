"""Messages read back from a ChatML prompt, and the message helpers the model reasons with.

Token-level routes get a rendered prompt, not messages; the Qwen chat template is ChatML, so
its turns, tools and tool results can be read back and answered like a chat request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .hermes import TOOL_CALL_START
from .wire import JSON

_CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n?|$)", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.DOTALL)
_TOOL_RESPONSE_BLOCK = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)


def ascii_text(value: Any, limit: int) -> str:
    """Printable ASCII, one line: keeps every token prefix decodable on its own."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = text.encode("ascii", "replace").decode().replace("\n", " ").strip()
    return text[:limit]


def message_text(content: Any) -> str:
    """Message content as a string: text parts joined the way vLLM's "string" format does."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        return "\n".join(str(p) for p in parts)
    return str(content)


def tool_rounds(messages: Sequence[JSON]) -> int:
    """Assistant turns that called tools so far."""
    return sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))


def parse_chatml(text: str) -> tuple[list[JSON], list[JSON]] | None:
    """Messages and tools back from a ChatML prompt that ends with a generation prompt.

    Lets token-level routes (`/v1/completions` with ids, `/inference/v1/generate`, SGLang's
    `/generate`) answer a rendered conversation exactly like the chat route does.
    """
    if not text.rstrip(" ").endswith("<|im_start|>assistant\n"):
        return None
    messages: list[JSON] = []
    tools: list[JSON] = []
    for role, body in _CHATML_TURN.findall(text):
        if role == "system" and "<tools>" in body:
            tools.extend(_json_objects(body.rsplit("<tools>", 1)[1].split("</tools>", 1)[0]))
            continue
        if role == "user" and "<tool_response>" in body:
            messages.extend(
                {"role": "tool", "content": r} for r in _TOOL_RESPONSE_BLOCK.findall(body)
            )
            continue
        if role == "assistant" and TOOL_CALL_START in body:
            calls = [{"function": c} for c in _TOOL_CALL_BLOCK.findall(body)]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            continue
        messages.append({"role": role, "content": body})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        messages.pop()  # the empty generation prompt
    return messages, tools


def _json_objects(text: str) -> list[JSON]:
    """The JSON objects written back to back (the template joins tools without separators)."""
    decoder = json.JSONDecoder()
    out: list[JSON] = []
    pos = 0
    while (start := text.find("{", pos)) != -1:
        try:
            obj, pos = decoder.raw_decode(text, start)
        except ValueError:
            break
        if isinstance(obj, dict):
            out.append(obj)
    return out
