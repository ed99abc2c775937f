"""Hermes `<tool_call>` blocks parsed the way vLLM's `hermes` tool parser does.

Both the whole-text extraction (non-streaming) and the incremental deltas (streaming) follow
vLLM's parser, so tool calls reach clients in the same pieces as from a real server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from .wire import JSON

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_HERMES_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_HERMES_ARGS = re.compile(r'"arguments"\s*:\s*')
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def hermes_extract(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) as vLLM's hermes parser returns them, or None.

    None means "no tool call": the text is plain content. Arguments are re-serialized with
    `json.dumps(..., ensure_ascii=False)`, as the parser does.
    """
    if TOOL_CALL_START not in text:
        return None
    try:
        calls = []
        for closed, unclosed in _HERMES_CALL.findall(text):
            raw = json.loads(closed if closed else unclosed)
            calls.append((str(raw["name"]), json.dumps(raw["arguments"], ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return None
    content = text[: text.find(TOOL_CALL_START)]
    return (content or None), calls


def _tag_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HermesStream:
    """Incremental tool-call deltas, mirroring vLLM's streaming hermes parser.

    Re-parses the whole text on every token and diffs it against what was already sent:
    content before `<tool_call>`, then per call the name (with a fresh `chatcmpl-tool-` id)
    once it is complete, then argument fragments as they grow.
    """

    def __init__(self, make_id: Callable[[int], str]) -> None:
        self._make_id = make_id
        self._sent_content = 0
        self._names: list[str | None] = []
        self._args: list[str] = []
        self.tools_streamed = False

    def feed(self, text: str) -> tuple[str | None, list[JSON]] | None:
        """The delta for the text so far: (content, tool_call deltas), or None."""
        if TOOL_CALL_START in text:
            sendable = text.index(TOOL_CALL_START)
        else:
            sendable = len(text) - _tag_overlap(text, TOOL_CALL_START)
        content = None
        if sendable > self._sent_content:
            content = text[self._sent_content : sendable]
            self._sent_content = sendable
        deltas: list[JSON] = []
        for i, (body, complete) in enumerate(self._regions(text)):
            if i >= len(self._names):
                self._names.append(None)
                self._args.append("")
            if self._names[i] is None:
                match = _HERMES_NAME.search(body)
                if match is None:
                    break
                self._names[i] = match.group(1)
                deltas.append(
                    {
                        "id": self._make_id(i),
                        "type": "function",
                        "index": i,
                        "function": {"name": match.group(1)},
                    }
                )
            args = self._arguments(body, complete)
            if args is not None and len(args) > len(self._args[i]):
                diff = args[len(self._args[i]) :]
                self._args[i] = args
                deltas.append({"index": i, "function": {"arguments": diff}})
        if deltas:
            self.tools_streamed = True
        if content or deltas:
            return content, deltas
        return None

    @staticmethod
    def _regions(text: str) -> list[tuple[str, bool]]:
        regions: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(TOOL_CALL_START, pos)) != -1:
            body_start = start + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body_start)
            if end != -1:
                regions.append((text[body_start:end].strip(), True))
                pos = end + len(TOOL_CALL_END)
                continue
            raw = text[body_start:]
            overlap = _tag_overlap(raw, TOOL_CALL_END)
            body = (raw[:-overlap] if overlap else raw).strip()
            regions.append((body, bool(body) and _complete_json(body)))
            break
        return regions

    @staticmethod
    def _arguments(body: str, complete: bool) -> str | None:
        match = _HERMES_ARGS.search(body)
        if match is None:
            return None
        raw = body[match.end() :]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw
