"""The API dialects the proxy parses, by route: one module per dialect, each naming its
declaration in `trajectories/dialects.py` (name, routes, prompt ids field). Adding one = its
declaration there, its module here and one line in `PARSERS`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trace_proxy.capture.dialects import (
    openai_chat,
    openai_completions,
    sglang_generate,
    vllm_generate,
)
from trace_proxy.capture.dialects.common import ParsedCall, ParseError
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.dialects import Dialect

Parser = Callable[[Exchange, Mapping[str, Any]], list[ParsedCall]]

PARSERS: dict[Dialect, Parser] = {
    module.DIALECT: module.parse
    for module in (openai_chat, openai_completions, vllm_generate, sglang_generate)
}
DIALECTS: dict[str, tuple[str, Parser]] = {
    route: (dialect.name, parse) for dialect, parse in PARSERS.items() for route in dialect.routes
}
# Routes whose request may carry the prompt as token ids, and the field (`decode_request`).
PROMPT_IDS: dict[str, str] = {
    route: dialect.prompt_ids
    for dialect in PARSERS
    if dialect.prompt_ids
    for route in dialect.routes
}

__all__ = ["DIALECTS", "PARSERS", "PROMPT_IDS", "ParseError", "ParsedCall", "Parser"]
