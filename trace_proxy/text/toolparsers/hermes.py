"""`hermes` (the default): Qwen2.5 / Qwen3 / Hermes-2-Pro JSON calls.

Calls are `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; results are
`<tool_response>\\n...\\n</tool_response>` blocks in a user turn. The format follows vLLM's
hermes_tool_parser and the published chat templates; the class says where it differs.
"""

from __future__ import annotations

from trace_proxy.text.toolparsers.common import (
    NOT_CLOSED,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ChatMLParser,
    Found,
    UnparsedToolCall,
    call_from_json,
    truncated,
)


class HermesParser(ChatMLParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (vLLM's `hermes`).

    Differences from vLLM's Hermes2ProToolParser, which would drop all calls of a response if
    one is invalid, and accepts an unclosed last block whose JSON happens to be complete:
    here each block stands alone, and a block without `</tool_call>` is unparsed (an agent
    parsing `<tool_call>(.*?)</tool_call>`, as verl does, never ran it). Content is all the
    text outside the blocks, not only the text before the first one.
    """

    name: str = "hermes"

    def scan(self, body: str, found: Found) -> None:
        pos = 0
        while True:
            start = body.find(TOOL_CALL_START, pos)
            if start == -1:
                found.content.append(body[pos:])
                return
            found.content.append(body[pos:start])
            inner = start + len(TOOL_CALL_START)
            end = body.find(TOOL_CALL_END, inner)
            reopen = body.find(TOOL_CALL_START, inner)
            # A <tool_call> before </tool_call>: either the block was cut and the model started
            # over, or the arguments hold that text (code about tool calls). JSON decides.
            if -1 < reopen < end and not isinstance(call_from_json(body[inner:end]), str):
                reopen = -1
            if end == -1 or (reopen != -1 and reopen < end):
                stop = len(body) if reopen == -1 else reopen
                raw = body[start:stop]
                if reopen == -1:
                    complete = not isinstance(call_from_json(body[inner:stop]), str)
                    note = "; the JSON inside is complete" if complete else ""
                    error = truncated(TOOL_CALL_END, note)
                else:
                    error = NOT_CLOSED
                found.unparsed.append(UnparsedToolCall(raw=raw.rstrip(), error=error))
                if reopen == -1:
                    return
                pos = reopen
                continue
            stop = end + len(TOOL_CALL_END)
            parsed = call_from_json(body[inner:end])
            if isinstance(parsed, str):
                found.unparsed.append(UnparsedToolCall(raw=body[start:stop], error=parsed))
            else:
                found.calls.append(parsed)
            pos = stop
