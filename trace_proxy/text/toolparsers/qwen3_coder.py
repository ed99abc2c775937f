"""`qwen3_coder`: Qwen3-Coder's XML calls.

Calls are
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
Values are text; as vLLM does without a tools schema, arguments become a JSON object of
strings (the template renders numbers and booleans as Python text, so their type is lost).
Results as for hermes. The format follows vLLM's parser/qwen3.py and the published chat
template; the class says where it differs.
"""

from __future__ import annotations

from trace_proxy.text.toolparsers.common import (
    NOT_CLOSED,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ChatMLParser,
    Found,
    ParsedToolCall,
    UnparsedToolCall,
    call_from_json,
    dumps,
    trim_wrapping_newlines,
    truncated,
)

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"


def _parse_parameters(body: str) -> dict[str, str]:
    """`<parameter=NAME>VALUE</parameter>` pairs; a value also ends at the next parameter or at
    the end of the function (a missing `</parameter>`). The first occurrence of a name keeps its
    place, the last value wins (as a dict built by vLLM's converter)."""
    params: dict[str, str] = {}
    pos = 0
    while True:
        start = body.find(PARAMETER_START, pos)
        if start == -1:
            return params
        name_start = start + len(PARAMETER_START)
        close = body.find(">", name_start)
        if close == -1:
            return params
        name = body[name_start:close].strip()
        value_start = close + 1
        end = body.find(PARAMETER_END, value_start)
        following = body.find(PARAMETER_START, value_start)
        if end == -1 or (following != -1 and following < end):
            value_end = following if following != -1 else len(body)
            pos = value_end
        else:
            value_end = end
            pos = end + len(PARAMETER_END)
        if name:
            params[name] = trim_wrapping_newlines(body[value_start:value_end])


def _parse_function(text: str) -> ParsedToolCall | str:
    """`<function=NAME>...` up to (excluding) its `</function>` or the end of its block."""
    body_start = text.find(">", len(FUNCTION_START))
    if body_start == -1 or "\n" in text[len(FUNCTION_START) : body_start]:
        return "function name not closed with '>'"
    name = text[len(FUNCTION_START) : body_start].strip()
    if not name:
        return "empty function name"
    return ParsedToolCall(name=name, arguments=dumps(_parse_parameters(text[body_start + 1 :])))


class Qwen3CoderParser(ChatMLParser):
    """Qwen3-Coder's `<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>`
    (vLLM's `qwen3_coder`).

    As in vLLM's Qwen3 grammar: several `<function=` in one block are several calls; a
    `<function=...>...</function>` without the `<tool_call>` wrapper is a call; a block holding
    Hermes JSON instead of `<function=` is read as JSON; a function whose `</function>` was
    written is complete even if `</tool_call>` is missing; parameter values lose one wrapping
    newline on each side and stay strings (no tools schema here to coerce them).
    A function cut off before `</function>` is unparsed.
    """

    name: str = "qwen3_coder"

    def scan(self, body: str, found: Found) -> None:
        pos = 0
        while True:
            block = body.find(TOOL_CALL_START, pos)
            bare = body.find(FUNCTION_START, pos)
            if block == -1 and bare == -1:
                found.content.append(body[pos:])
                return
            if block == -1 or (bare != -1 and bare < block):
                # A function without the <tool_call> wrapper.
                found.content.append(body[pos:bare])
                end = body.find(FUNCTION_END, bare)
                if end == -1:
                    error = truncated(FUNCTION_END, "")
                    found.unparsed.append(UnparsedToolCall(raw=body[bare:].rstrip(), error=error))
                    return
                pos = end + len(FUNCTION_END)
                self._add(body[bare:end], body[bare:pos], found)
                continue
            found.content.append(body[pos:block])
            inner = block + len(TOOL_CALL_START)
            end = body.find(TOOL_CALL_END, inner)
            reopen = body.find(TOOL_CALL_START, inner)
            closed = end != -1 and (reopen == -1 or end < reopen)
            stop = end if closed else (len(body) if reopen == -1 else reopen)
            after = stop + len(TOOL_CALL_END) if closed else stop
            at_end = not closed and reopen == -1
            self._parse_block(body[inner:stop], body[block:after], closed, at_end, found)
            pos = after

    @staticmethod
    def _add(function: str, raw: str, found: Found) -> None:
        parsed = _parse_function(function)
        if isinstance(parsed, str):
            found.unparsed.append(UnparsedToolCall(raw=raw, error=parsed))
        else:
            found.calls.append(parsed)

    def _parse_block(self, inner: str, raw: str, closed: bool, at_end: bool, found: Found) -> None:
        first = inner.find(FUNCTION_START)
        if first == -1:
            if not closed:
                error = truncated(TOOL_CALL_END, "") if at_end else NOT_CLOSED
                found.unparsed.append(UnparsedToolCall(raw=raw.rstrip(), error=error))
                return
            parsed = call_from_json(inner)
            if isinstance(parsed, str):
                error = f"no {FUNCTION_START}NAME> in tool call ({parsed})"
                found.unparsed.append(UnparsedToolCall(raw=raw, error=error))
            else:
                found.calls.append(parsed)
            return
        starts = []
        at = first
        while at != -1:
            starts.append(at)
            at = inner.find(FUNCTION_START, at + len(FUNCTION_START))
        many = len(starts) > 1
        for k, start in enumerate(starts):
            limit = starts[k + 1] if k + 1 < len(starts) else len(inner)
            end = inner.find(FUNCTION_END, start, limit)
            if end != -1:
                one_raw = inner[start : end + len(FUNCTION_END)] if many else raw
                self._add(inner[start:end], one_raw, found)
            elif closed or k + 1 < len(starts):
                # </tool_call> (or the next function) ends it: vLLM's grammar accepts this.
                self._add(inner[start:limit], inner[start:limit] if many else raw, found)
            else:
                piece = inner[start:].rstrip() if many else raw.rstrip()
                error = truncated(FUNCTION_END, "") if at_end else NOT_CLOSED
                found.unparsed.append(UnparsedToolCall(raw=piece, error=error))
