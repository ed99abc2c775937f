"""Tool spans inferred from the traffic: what the agent ran between two generate calls.

Chat dialects say it outright: response N's `tool_calls`, matched by id to the `role: tool`
messages of request N+1. Token dialects say it in text: the decoded response holds tool-call
markup (parsed by the configured parser), and the tool results are the tokens that request
N+1's prompt adds after response N. Either way the span runs from the end of response N to
the start of request N+1: the agent's tool time. A result that reads like verl's
"Error when executing tool: ..." marks the span as a tool error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trace_proxy.trajectories.prompts import common_prefix
from trace_proxy.trajectories.record import CallError, GenerateCall, ToolCall
from trace_proxy.trajectories.toolparsers import ToolCallParser

ERROR_PREFIXES = ("Error when executing tool", "Error:", "error:")


def _tool_error(result: str | None) -> CallError | None:
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
                    error=_tool_error(result),
                )
            )
    return spans


def text_tool_spans(
    calls: Sequence[GenerateCall],
    full_prompts: Sequence[list[int] | None],
    decoders: Sequence[Callable[[Sequence[int]], str] | None],
    parser: ToolCallParser,
) -> list[ToolCall]:
    """Spans for tool calls written in decoded text (token dialects), with their results;
    a reply that came back as text only (no token ids asked for) is read as it came."""
    spans: list[ToolCall] = []
    for position, call in enumerate(calls):
        output = call.outputs[0] if call.outputs else None
        decode = decoders[position]
        if output is None or output.tool_calls or decode is None:
            continue
        # A reply that came as text only (no ids to decode) is read as it came.
        text = output.response_text or (None if output.token_ids else output.text)
        if not isinstance(text, str) or not text:
            continue
        parsed = parser.parse_response(text)
        if not parsed.calls and not parsed.unparsed:
            continue
        follow = calls[position + 1] if position + 1 < len(calls) else None
        results = _results_after(position, calls, full_prompts, decode, parser)
        if len(results) != len(parsed.calls):
            results = []  # calls and results do not line up: pairing them would misattribute
        end = follow.start if follow is not None else None
        for k, found in enumerate(parsed.calls):
            result = results[k] if results else None
            spans.append(
                ToolCall(
                    index=len(spans), observed="parsed_from_text",
                    start=call.end or call.start, end=end, name=found.name,
                    arguments=found.arguments, result=result, requested_by=position,
                    error=_tool_error(result),
                )
            )  # fmt: skip
        for bad in parsed.unparsed:
            spans.append(
                ToolCall(
                    index=len(spans), observed="parsed_from_text",
                    start=call.end or call.start, end=end, requested_by=position, raw=bad.raw,
                    error=CallError(type="unparsed_tool_call", message=bad.error),
                )
            )  # fmt: skip
    return spans


def _results_after(
    position: int,
    calls: Sequence[GenerateCall],
    full_prompts: Sequence[list[int] | None],
    decode: Callable[[Sequence[int]], str],
    parser: ToolCallParser,
) -> list[str]:
    """Tool results: the text the next prompt adds after this call's prompt and response.

    Some chat templates re-render the assistant turn (gpt-oss's harmony rewrites its headers and
    `<|return|>`), so the next prompt need not repeat the response token for token: what it adds
    is read from where it stops agreeing with prompt + response, provided it repeats the whole
    prompt."""
    if position + 1 >= len(calls):
        return []
    prompt, following = full_prompts[position], full_prompts[position + 1]
    output_ids = calls[position].outputs[0].token_ids or []
    if prompt is None or following is None:
        return []
    shared = common_prefix([*prompt, *output_ids], following)
    if shared < len(prompt):
        return []
    return parser.tool_results(decode(following[shared:]))
