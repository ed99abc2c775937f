"""`gpt_oss`: GPT-OSS's harmony format.

A call is a message to a recipient,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
`{...}<|call|>` (the recipient may also come before `<|channel|>`); `analysis` is reasoning;
`final` (and `commentary` without a recipient, a preamble) is content. Results are messages
from the tool: `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>R<|end|>`.
The format follows vLLM's parser/harmony.py and the published chat template; the class says
where it differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from trace_proxy.text.toolparsers.common import (
    ParsedResponse,
    ParsedToolCall,
    Turn,
    UnparsedToolCall,
    dumps,
    loads,
    strip_end_markers,
    truncated,
)

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
    """One message as written; `body` and `terminator` say where a cut-off text stopped."""

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

    def turns(self, text: str, after_answer: bool = False) -> list[Turn] | None:
        """Harmony messages as turns: a tool's message (`functions.NAME`) a tool turn, an
        assistant's consecutive messages (analysis, calls, final) one assistant turn as
        written; a last assistant message left open is the generation prompt."""
        head, start, rest = text.partition(H_START)
        if head.strip() and not (after_answer and head.strip() in _H_TERMINATORS):
            return None
        found: list[Turn] = []
        messages = _harmony_messages(start + rest) if start else []
        for k, message in enumerate(messages):
            if message.body is None or message.terminator is None:
                if k == len(messages) - 1 and message.role == "assistant":
                    break  # the generation prompt
                return None
            if message.role == "assistant":
                if found and found[-1].role == "assistant":
                    found[-1] = Turn("assistant", found[-1].content + message.raw)
                else:
                    found.append(Turn("assistant", message.raw))
            elif message.role in _H_ROLES:
                found.append(Turn(message.role, message.body))
            elif message.role:
                found.append(Turn("tool", message.body, message.role.removeprefix("functions.")))
            else:
                return None
        return found
