"""Tool calls and tool results recovered from decoded text, for token-in/token-out dialects.

vLLM's `/inference/v1/generate`, `/v1/completions` with token ids and SGLang's `/generate` return
only token ids. Once decoded (special tokens kept), the response holds the tool calls in the
model's own markup, and the tokens that the next prompt adds after the response hold the tool
results in the chat template's markup. The parsers here read both, as pure functions over text:

- `hermes` (default): Qwen2.5 / Qwen3 / Hermes-2-Pro. Calls are
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; results are
  `<tool_response>\\n...\\n</tool_response>` blocks in a user turn.
- `qwen3_coder`: Qwen3-Coder's XML calls,
  `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
  Values are text; as vLLM does without a tools schema, arguments become a JSON object of
  strings (the template renders numbers and booleans as Python text, so their type is lost).
  Results as for hermes.
- `gpt_oss`: the harmony format. A call is a message to a recipient,
  `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
  `{...}<|call|>` (the recipient may also come before `<|channel|>`); `analysis` is reasoning;
  `final` (and `commentary` without a recipient, a preamble) is content. Results are messages
  from the tool: `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>R<|end|>`.

Calls that cannot be parsed are kept raw with the reason (`UnparsedToolCall`): a block whose
closing marker never came (a length-limited generation), invalid JSON, a missing name.
The formats follow vLLM's parsers (hermes_tool_parser, parser/qwen3.py, parser/harmony.py) and
the published chat templates; see docs in each parser class for the differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from trace_proxy.trajectories.toolparsers.common import (
    NOT_CLOSED,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ChatMLParser,
    Found,
    ParsedResponse,
    ParsedToolCall,
    ToolCallParser,
    UnparsedToolCall,
    call_from_json,
    dumps,
    loads,
    strip_end_markers,
    trim_wrapping_newlines,
    truncated,
)
from trace_proxy.trajectories.toolparsers.hermes import HermesParser

__all__ = [
    "DEFAULT_PARSER",
    "PARSERS",
    "GptOssParser",
    "HermesParser",
    "ParsedResponse",
    "ParsedToolCall",
    "Qwen3CoderParser",
    "ToolCallParser",
    "UnparsedToolCall",
    "get_parser",
]


# ---------------------------------------------------------------------------------------------
# Qwen3-Coder XML calls


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


# ---------------------------------------------------------------------------------------------
# GPT-OSS harmony


H_START = "<|start|>"
H_MESSAGE = "<|message|>"
H_CHANNEL = "<|channel|>"
H_CONSTRAIN = "<|constrain|>"
H_END = "<|end|>"
H_CALL = "<|call|>"
H_RETURN = "<|return|>"
_H_TERMINATORS = (H_END, H_CALL, H_RETURN)
_H_END_MARKERS = ("<|endoftext|>",)
_H_ROLES = frozenset(("system", "developer", "user", "assistant"))


@dataclass(frozen=True, slots=True)
class _HarmonyMessage:
    raw: str  # as written, from <|start|> (or the response's start) to its terminator
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str | None  # None: the header never reached <|message|>
    terminator: str | None  # None: the text ended inside the message


def _harmony_header(
    header: str, implicit_role: str
) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, content type) of `role[ to=R]<|channel|>ch[ to=R][ type]`."""
    content_type = None
    at = header.find(H_CONSTRAIN)
    if at != -1:
        content_type = header[at + len(H_CONSTRAIN) :].strip() or None
        header = header[:at]
    at = header.find(H_CHANNEL)
    if at == -1:
        role_part, channel_part = header, ""
    else:
        role_part, channel_part = header[:at], header[at + len(H_CHANNEL) :]
    role = implicit_role
    recipient = None
    for k, word in enumerate(role_part.split()):
        if word.startswith("to="):
            recipient = word[3:]
        elif k == 0:
            role = word
    channel = None
    for word in channel_part.split():
        if word.startswith("to="):
            recipient = word[3:]
        elif channel is None:
            channel = word
        elif content_type is None:
            content_type = word  # the legacy `<|channel|>commentary json` header
    if recipient is not None:
        recipient = recipient.split("<|", 1)[0] or None
    return role, channel, recipient, content_type


def _harmony_messages(text: str) -> list[_HarmonyMessage]:
    """The messages of a harmony text. The part before the first `<|start|>` continues a message
    whose `<|start|>assistant` is in the prompt."""
    messages: list[_HarmonyMessage] = []
    for k, chunk in enumerate(text.split(H_START)):
        if k == 0 and not chunk.strip():
            continue
        at = chunk.find(H_MESSAGE)
        if at == -1:
            header, rest = chunk, None
        else:
            header, rest = chunk[:at], chunk[at + len(H_MESSAGE) :]
        body = terminator = None
        end = len(chunk)
        if rest is not None:
            cut = len(rest)
            for candidate in _H_TERMINATORS:
                where = rest.find(candidate, 0, cut)
                if where != -1:
                    cut, terminator = where, candidate
            body = rest[:cut]
            end = at + len(H_MESSAGE) + cut + (len(terminator) if terminator else 0)
        role, channel, recipient, content_type = _harmony_header(
            header, "assistant" if k == 0 else ""
        )
        raw = chunk[:end] if k == 0 else H_START + chunk[:end]
        messages.append(
            _HarmonyMessage(raw, role, channel, recipient, content_type, body, terminator)
        )
    return messages


class GptOssParser:
    """GPT-OSS harmony messages (vLLM's `openai` tool parser / HarmonyParser).

    A message with a recipient other than `assistant` is a call, named by the recipient without
    its `functions.` namespace; unlike vLLM's chat API this also keeps calls to the built-in
    `browser.*` / `python` tools. JSON arguments (content type `json`, `<|constrain|>json`, or
    none) are normalised; other content types (`code`) are kept as written. `<|call|>` is a stop
    token a server may leave out, so a call at the end of the text without it is complete when
    its JSON is; invalid JSON is unparsed (vLLM would pass it through as the arguments).
    Reasoning and content are the analysis / final (and recipient-less commentary) bodies joined
    by newlines; text with no harmony markup at all is content (vLLM's fallback).
    """

    name: str = "gpt_oss"

    def parse_response(self, text: str) -> ParsedResponse:
        text = strip_end_markers(text, _H_END_MARKERS)
        if H_MESSAGE not in text and H_CHANNEL not in text and H_START not in text:
            plain = text.strip() or None
            return ParsedResponse(content=plain, reasoning=None, calls=[], unparsed=[])
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        unparsed: list[UnparsedToolCall] = []
        for message in _harmony_messages(text):
            if message.role != "assistant":
                continue  # a tool or user message the model wrote itself: not its output
            recipient = message.recipient
            if recipient is not None and recipient != "assistant":
                result = self._call(message, recipient)
                if isinstance(result, UnparsedToolCall):
                    unparsed.append(result)
                else:
                    calls.append(result)
            elif message.body is None:
                continue
            elif message.channel == "analysis":
                reasoning.append(message.body)
            else:
                content.append(message.body)
        return ParsedResponse(
            content="\n".join(content).strip() or None,
            reasoning="\n".join(reasoning).strip() or None,
            calls=calls,
            unparsed=unparsed,
        )

    @staticmethod
    def _call(message: _HarmonyMessage, recipient: str) -> ParsedToolCall | UnparsedToolCall:
        raw = message.raw.rstrip() if message.terminator is None else message.raw
        name = recipient.removeprefix("functions.")
        if not name:
            return UnparsedToolCall(raw=raw, error=f"no function name in recipient {recipient!r}")
        if message.body is None:
            return UnparsedToolCall(raw=raw, error=truncated(H_MESSAGE, " in the message header"))
        content_type = message.content_type
        if content_type is not None and "json" not in content_type:
            return ParsedToolCall(name=name, arguments=message.body)
        try:
            arguments = dumps(loads(message.body))
        except ValueError as exc:
            if message.terminator is None:
                return UnparsedToolCall(raw=raw, error=truncated(H_CALL, f"; {exc}"))
            return UnparsedToolCall(raw=raw, error=f"invalid JSON arguments: {exc}")
        return ParsedToolCall(name=name, arguments=arguments)

    def tool_results(self, added_text: str) -> list[str]:
        results: list[str] = []
        for message in _harmony_messages(added_text):
            # Authors other than the four roles are tools (`functions.NAME`, `browser`, ...).
            if message.role not in _H_ROLES and message.role and message.body is not None:
                results.append(message.body)
        return results


# ---------------------------------------------------------------------------------------------
# Registry


PARSERS: dict[str, ToolCallParser] = {
    parser.name: parser for parser in (HermesParser(), Qwen3CoderParser(), GptOssParser())
}
DEFAULT_PARSER = "hermes"

# The names vLLM's --tool-call-parser uses for the same formats.
_ALIASES = {
    "openai": "gpt_oss",
    "harmony": "gpt_oss",
    "qwen3_xml": "qwen3_coder",
    "qwen3_json": "hermes",
    "qwen": "hermes",
}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered under `name` (or vLLM's name for it); ValueError if unknown."""
    key = name.strip().lower().replace("-", "_")
    parser = PARSERS.get(_ALIASES.get(key, key))
    if parser is None:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    return parser
