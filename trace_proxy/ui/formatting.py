"""How values read on a page: the templates' filters for numbers, times and JSON."""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

DASH = "\u2013"  # shown for a missing value


def num(value: Any, digits: int = 3) -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def when(value: Any) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return DASH
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + " UTC"


def secs(value: Any) -> str:
    return DASH if not isinstance(value, (int, float)) else f"{value:.2f}s"


def quoted(value: Any) -> str:
    """A token's text as a JSON string: quoted, its spaces and line breaks visible."""
    return DASH if value is None else orjson.dumps(str(value)).decode()


def json_text(value: Any) -> str:
    if isinstance(value, str):
        try:  # arguments are JSON text: shown indented when they parse
            return orjson.dumps(orjson.loads(value), option=orjson.OPT_INDENT_2).decode()
        except orjson.JSONDecodeError:
            return value
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS,
                        default=str).decode()  # fmt: skip
