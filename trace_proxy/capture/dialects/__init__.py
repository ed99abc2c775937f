"""The API dialects the proxy understands, by route. Adding one = one module + one line here."""

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

Parser = Callable[[Exchange, Mapping[str, Any]], list[ParsedCall]]

DIALECTS: dict[str, tuple[str, Parser]] = {
    route: (module.NAME, module.parse)
    for module in (openai_chat, openai_completions, vllm_generate, sglang_generate)
    for route in module.ROUTES
}

__all__ = ["DIALECTS", "ParseError", "ParsedCall", "Parser"]
