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

_MODULES = (openai_chat, openai_completions, vllm_generate, sglang_generate)
DIALECTS: dict[str, tuple[str, Parser]] = {
    route: (module.NAME, module.parse) for module in _MODULES for route in module.ROUTES
}
# Routes whose request may carry the prompt as token ids, and the field (`decode_request`).
PROMPT_IDS: dict[str, str] = {
    route: module.PROMPT_IDS
    for module in _MODULES
    if getattr(module, "PROMPT_IDS", None)
    for route in module.ROUTES
}

__all__ = ["DIALECTS", "PROMPT_IDS", "ParseError", "ParsedCall", "Parser"]
