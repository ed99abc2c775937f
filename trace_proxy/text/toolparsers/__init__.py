"""Tool calls and tool results recovered from decoded text, for token-in/token-out dialects.

vLLM's `/inference/v1/generate`, `/v1/completions` with token ids and SGLang's `/generate` return
only token ids. Once decoded (special tokens kept), the response holds the tool calls in the
model's own markup, and the tokens that the next prompt adds after the response hold the tool
results in the chat template's markup. The parsers read both, and the turns a prompt's text
writes (its roles, from the template's markers), as pure functions over text, one module per
format (each says which of vLLM's parsers and which chat templates it follows):

- `hermes` (default): Qwen2.5 / Qwen3 / Hermes-2-Pro, JSON in `<tool_call>` blocks.
- `qwen3_coder`: Qwen3-Coder, XML `<function=NAME><parameter=P>` in `<tool_call>` blocks.
- `gpt_oss`: GPT-OSS's harmony format, a call being a message to a recipient.

`common` holds what they share. Adding a format = one module + its parser in `PARSERS`.
"""

from __future__ import annotations

from trace_proxy.text.toolparsers.common import (
    ParsedResponse,
    ParsedToolCall,
    ToolCallParser,
    Turn,
    UnparsedToolCall,
)
from trace_proxy.text.toolparsers.gpt_oss import GptOssParser
from trace_proxy.text.toolparsers.hermes import HermesParser
from trace_proxy.text.toolparsers.qwen3_coder import Qwen3CoderParser

__all__ = [
    "DEFAULT_PARSER",
    "PARSERS",
    "GptOssParser",
    "HermesParser",
    "ParsedResponse",
    "ParsedToolCall",
    "Qwen3CoderParser",
    "ToolCallParser",
    "Turn",
    "UnparsedToolCall",
    "get_parser",
]

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
