"""Tool spans from decoded text: what a token dialect's agent ran between two generate calls.

The decoded response holds tool-call markup (read by the configured parser, `--tool-parser`),
and the tool results are the text that request N+1's prompt adds after response N. The span
runs from the end of response N to the start of request N+1, as a chat dialect's does
(`trace_proxy/trajectories/tools.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trace_proxy.text.toolparsers import ToolCallParser
from trace_proxy.trajectories.prompts import common_prefix
from trace_proxy.trajectories.record import CallError, GenerateCall, ToolCall
from trace_proxy.trajectories.tools import tool_error


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
                    error=tool_error(result),
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
