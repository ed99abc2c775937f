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


# What a header name means for the record, by the name as sent: (its lowered form, whether it is
# left out, whether it is a secret). Clients send the same dozen names on every call; bounded,
# since a client may send any.
_NAMES: dict[str, tuple[str, bool, bool]] = {}
MAX_NAMES = 4096


def _name(name: str) -> tuple[str, bool, bool]:
    lowered = clean_text(name.lower())
    return lowered, lowered in _NOT_RECORDED, is_secret_header(lowered)


def recorded_headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Request headers as a record keeps them: secrets replaced, framing headers left out,
    bytes that were not UTF-8 as U+FFFD."""
    kept: dict[str, str] = {}
    names = _NAMES
    for name, value in items:
        known = names.get(name)
        if known is None:
            if len(names) >= MAX_NAMES:
                names.clear()
            known = names[name] = _name(name)
        lowered, left_out, secret = known
        if left_out:
            continue
        kept[lowered] = REDACTED if secret else value if value.isascii() else clean_text(value)
    return kept
