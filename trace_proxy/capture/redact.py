"""Secrets never reach a record or a log: credentials are dropped from recorded headers."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from trace_proxy.safejson import clean_text

_SECRET_HEADER = re.compile(
    r"authorization|cookie|api[-_]?key|token|secret|password|credential|session[-_]?key",
    re.IGNORECASE,
)
REDACTED = "[redacted]"
_NOT_RECORDED = frozenset({"content-length", "host", "connection", "keep-alive"})


@lru_cache(maxsize=4096)  # a few names, sent again with every call
def is_secret_header(name: str) -> bool:
    return _SECRET_HEADER.search(name) is not None


def recorded_headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Request headers as a record keeps them: secrets replaced, framing headers left out,
    bytes that were not UTF-8 as U+FFFD."""
    kept: dict[str, str] = {}
    for name, value in items:
        lowered = clean_text(name.lower())
        if lowered in _NOT_RECORDED:
            continue
        kept[lowered] = REDACTED if is_secret_header(lowered) else clean_text(value)
    return kept
