"""What every tool-call parser shares: the parsed shapes, the parser protocol, strict JSON, and
the scanning of the ChatML family's markup (`<think>`, `<tool_call>`, `<tool_response>`) and of
its turns (`<|im_start|>ROLE\n...<|im_end|>`).

Calls that cannot be parsed are kept raw with the reason (`UnparsedToolCall`): a block whose
closing marker never came (a length-limited generation), invalid JSON, a missing name.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """A call as an OpenAI-style `tool_calls` entry would carry it."""

    name: str
    arguments: str  # a JSON string, json.dumps(obj, ensure_ascii=False) when the model wrote one


@dataclass(frozen=True, slots=True)
class UnparsedToolCall:
    """A call the agent could not have run, kept so that the record still shows it."""

    raw: str  # the tool-call text as the model wrote it
    error: str  # why it could not be parsed


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    """One decoded response split as a chat API would have returned it."""

    content: str | None  # text outside tool-call markup and reasoning, stripped; None if empty
    reasoning: str | None  # <think>...</think> / analysis channel text, if any
    calls: list[ParsedToolCall]
    unparsed: list[UnparsedToolCall]


@dataclass(frozen=True, slots=True)
class Turn:
    """One message as the chat template wrote it into a prompt; a tool result is a `tool` turn
    (`name`: the tool, when the template writes it)."""

    role: str
    content: str
    name: str | None = None


class ToolCallParser(Protocol):
    """One model family's markup, read both ways: calls in a response, results in a prompt."""

    name: str

    def parse_response(self, text: str) -> ParsedResponse:
        """Reasoning, content and tool calls of one decoded response."""
        ...

    def tool_results(self, added_text: str) -> list[str]:
        """Tool results, in order, in the text a prompt adds after the previous response."""
        ...

    def turns(self, text: str, after_answer: bool = False) -> list[Turn] | None:
        """The messages a piece of prompt text writes, in order, up to the generation prompt
        that ends it (if any); None when the text is not written in this family's chat
        template. `after_answer`: the piece follows a response, so it may first close the
        response's turn (the end-of-turn token a response cut short never wrote)."""
        ...


THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
CHATML_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n?", re.DOTALL)
CHATML_REPLY = "<|im_start|>assistant\n"  # the generation prompt


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """Strict JSON (no NaN/Infinity), as an agent's json.loads + a JSON consumer would need."""
    return json.loads(text, parse_constant=_reject_constant)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def strip_end_markers(text: str, markers: tuple[str, ...]) -> str:
    """Drop the end-of-turn tokens (and whitespace) at the end of a response."""
    while True:
        stripped = text.rstrip()
        for marker in markers:
            if stripped.endswith(marker):
                text = stripped[: -len(marker)]
                break
        else:
            return text


def trim_wrapping_newlines(value: str) -> str:
    """Remove the one newline the templates put on each side of a value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def split_reasoning(text: str, call_start: str) -> tuple[str | None, str]:
    """Split `<think>...</think>` off the front of a response.

    As vLLM's Qwen3 grammar does: reasoning opens with `<think>` at the start (or is implied when
    the template put `<think>` in the prompt and only `</think>` appears), and ends at `</think>`,
    at the first tool call (an implicit end) or at the end of a truncated generation.
    Without either tag there is no reasoning.
    """
    lead = len(text) - len(text.lstrip())
    if text.startswith(THINK_START, lead):
        begin = lead + len(THINK_START)
        end_tag = text.find(THINK_END, begin)
    else:
        begin = 0
        end_tag = text.find(THINK_END)
        if end_tag == -1:
            return None, text
    stop = end_tag if end_tag != -1 else len(text)
    call_at = text.find(call_start, begin, stop)
    if call_at != -1:
        stop = call_at
    reasoning = text[begin:stop].strip() or None
    rest = text[stop + len(THINK_END) :] if stop == end_tag else text[stop:]
    return reasoning, rest


def join_content(parts: list[str], drop_think_end: bool) -> str | None:
    """The text between the calls as one content string; None when there is none."""
    pieces = []
    for part in parts:
        if drop_think_end and THINK_END in part:
            part = part.replace(THINK_END, "")  # a duplicate </think> after the reasoning ended
        part = part.strip()
        if part:
            pieces.append(part)
    return "\n".join(pieces) or None


def truncated(closing: str, what: str) -> str:
    """The error of a call the text ends inside, most often one cut by max_tokens."""
    return (
        f"tool call not closed: the text ends before {closing} "
        f"(generation truncated, e.g. by max_tokens){what}"
    )


NOT_CLOSED = f"tool call not closed: a new {TOOL_CALL_START} starts before its {TOOL_CALL_END}"


def tagged_blocks(text: str, start_tag: str, end_tag: str) -> list[str]:
    """Bodies of the closed `start_tag ... end_tag` blocks, one wrapping newline trimmed."""
    found: list[str] = []
    pos = 0
    while True:
        start = text.find(start_tag, pos)
        if start == -1:
            return found
        body = start + len(start_tag)
        end = text.find(end_tag, body)
        if end == -1:
            return found
        found.append(trim_wrapping_newlines(text[body:end]))
        pos = end + len(end_tag)


def call_from_json(payload: str) -> ParsedToolCall | str:
    """A Hermes JSON call object, or why it is not one."""
    payload = payload.strip()
    if not payload:
        return "empty tool call"
    try:
        obj = loads(payload)
    except ValueError as exc:
        return f"invalid JSON in tool call: {exc}"
    if not isinstance(obj, dict):
        return f'tool call JSON is {type(obj).__name__}, not an object with "name"'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'tool call JSON has no "name" string'
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        args = {k: v for k, v in obj.items() if k != "name"}
    # A string is kept as written (a model that wrote its arguments as a JSON string).
    return ParsedToolCall(name=name, arguments=args if isinstance(args, str) else dumps(args))


@dataclass(slots=True)
class Found:
    """What a scan of a response body finds, in order: the text between calls, and the calls."""

    content: list[str] = field(default_factory=list)
    calls: list[ParsedToolCall] = field(default_factory=list)
    unparsed: list[UnparsedToolCall] = field(default_factory=list)


class ChatMLParser(ABC):
    """The frame hermes and qwen3_coder share, so that they differ only in how calls are written:
    end-of-turn tokens and `<think>` reasoning come off first, and results are the
    `<tool_response>` blocks of a user turn."""

    name: str

    def parse_response(self, text: str) -> ParsedResponse:
        text = strip_end_markers(text, CHATML_END_MARKERS)
        reasoning, body = split_reasoning(text, TOOL_CALL_START)
        found = Found()
        self.scan(body, found)
        return ParsedResponse(
            content=join_content(found.content, reasoning is not None),
            reasoning=reasoning,
            calls=found.calls,
            unparsed=found.unparsed,
        )

    @abstractmethod
    def scan(self, body: str, found: Found) -> None:
        """Add the text between calls and each call, parsed or not, to `found`."""

    def tool_results(self, added_text: str) -> list[str]:
        return tagged_blocks(added_text, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

    def turns(self, text: str, after_answer: bool = False) -> list[Turn] | None:
        return chatml_turns(text, after_answer)


def chatml_turns(text: str, after_answer: bool = False) -> list[Turn] | None:
    """`<|im_start|>ROLE\\n...<|im_end|>` turns, one after the other, then nothing or a
    generation prompt (and what a client put after it). A user turn holding only
    `<tool_response>` blocks is one tool turn per block, as the template writes `role: tool`."""
    position = 0
    if after_answer:  # what the response left of its turn's end: `<|im_end|>`, then `\n`
        position = len(CHATML_END_MARKERS[0]) if text.startswith(CHATML_END_MARKERS[0]) else 0
        position += text.startswith("\n", position)
    found: list[Turn] = []
    while (match := CHATML_TURN.match(text, position)) is not None:
        role, body = match.group(1), match.group(2)
        results = tagged_blocks(body, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
        if role == "user" and results and _only_tool_responses(body):
            found += [Turn("tool", result) for result in results]
        else:
            found.append(Turn(role, body))
        position = match.end()
    rest = text[position:]
    return found if not rest or rest.startswith(CHATML_REPLY) else None


def _only_tool_responses(body: str) -> bool:
    """Nothing but `<tool_response>` blocks and whitespace."""
    pattern = re.escape(TOOL_RESPONSE_START) + ".*?" + re.escape(TOOL_RESPONSE_END)
    return not re.sub(pattern, "", body, flags=re.DOTALL).strip()
