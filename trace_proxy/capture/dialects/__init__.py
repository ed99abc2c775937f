"""The API dialects the proxy parses, by route: every module of this package but `common` is
one dialect's parser, naming its declaration in `trajectories/dialects.py` (`DIALECT`) and
giving its `parse`. Adding a dialect = its declaration there and its module here: the modules
are found, not listed, so nothing else names them."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from trace_proxy.capture.dialects.common import ParsedCall, ParseError
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.dialects import DECLARED, Dialect

Parser = Callable[[Exchange, Mapping[str, Any]], list[ParsedCall]]

_SHARED = frozenset({"common"})  # what the parsers share: no dialect of its own


def _parser_modules() -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _SHARED)
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def _parsers(modules: list[ModuleType]) -> dict[Dialect, Parser]:
    """Each module's parser by its declaration, in the declarations' order; a module that names
    no declared dialect, or a dialect two modules parse, stops the import with its name."""
    found: dict[Dialect, Parser] = {}
    for module in modules:
        dialect, parse = getattr(module, "DIALECT", None), getattr(module, "parse", None)
        if dialect not in DECLARED or not callable(parse):
            raise ImportError(f"{module.__name__} must name a declared DIALECT and give parse")
        if dialect in found:
            raise ImportError(f"{module.__name__}: {dialect.name} already has a parser")
        found[dialect] = parse
    return {dialect: found[dialect] for dialect in DECLARED if dialect in found}


PARSERS: dict[Dialect, Parser] = _parsers(_parser_modules())
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
