"""Tool spans inferred from the traffic: what the agent ran between two generate calls.

Chat dialects say it outright: response N's `tool_calls`, matched by id to the `role: tool`
messages of request N+1. Token dialects say it in text, read where the text is decoded
(`trace_proxy/text/tools.py`). Either way the span runs from the end of response N to the
start of request N+1: the agent's tool time. A result that reads like verl's
"Error when executing tool: ..." marks the span as a tool error (`tool_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trace_proxy.trajectories.record import CallError, GenerateCall, ToolCall

ERROR_PREFIXES = ("Error when executing tool", "Error:", "error:")


def tool_error(result: str | None) -> CallError | None:
    if result is not None and result.lstrip().startswith(ERROR_PREFIXES):
        return CallError(type="tool_error", message=result.strip()[:2000])
    return None


def _message_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def chat_tool_spans(calls: Sequence[GenerateCall]) -> list[ToolCall]:
    """Spans for the structured tool calls of chat responses (calls in start order, with full
    prompts, i.e. before prefix sharing). Parallel calls of one response give parallel spans."""
    spans: list[ToolCall] = []
    for position, call in enumerate(calls):
        requested = [tc for o in call.outputs[:1] for tc in (o.tool_calls or [])]
        if not requested:
            continue
        follow = calls[position + 1] if position + 1 < len(calls) else None
        results: dict[str, str | None] = {}
        if follow is not None:
            for message in follow.prompt.messages or []:
                if isinstance(message, dict) and message.get("role") == "tool":
                    call_id = message.get("tool_call_id")
                    if isinstance(call_id, str):
                        results[call_id] = _message_text(message.get("content"))
        for tool_call in requested:
            call_id = tool_call.get("id")
            fn = tool_call.get("function") or {}
            result = results.get(call_id) if isinstance(call_id, str) else None
            spans.append(
                ToolCall(
                    index=len(spans),
                    observed="chat_tool_calls",
                    start=call.end or call.start,
                    end=follow.start if follow is not None else None,
                    name=fn.get("name"),
                    call_id=call_id,
                    arguments=fn.get("arguments"),
                    result=result,
                    requested_by=position,
                    error=tool_error(result),
                )
            )
    return spans
