"""JSON encoding that cannot fail on what came off the network.

orjson decodes JSON nested 1,024 deep but encodes only 255 levels, and it refuses strings with
lone surrogates, which is what aiohttp makes of header and path bytes that are not UTF-8
(`surrogateescape`). A record holding either could not be written, nor could the batch of
records spooled with it. `dumps` encodes with orjson as it is (the usual case costs nothing
more) and only when that fails encodes a copy with such strings repaired (U+FFFD for each
byte that was not UTF-8) and anything nested deeper than `MAX_DEPTH` replaced by a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import orjson

MAX_DEPTH = 128  # levels kept in the copy: a record nests a few more around its values
TOO_DEEP = "[nested too deep to record]"
_INT_RANGE = range(-(1 << 63), 1 << 64)  # what orjson writes as an integer


def dumps(
    value: Any, default: Callable[[Any], Any] | None = None, option: int | None = None
) -> bytes:
    """`orjson.dumps`, or when it fails, the same of `encodable(value)`."""
    try:
        return orjson.dumps(value, default=default, option=option)
    except TypeError:  # orjson.JSONEncodeError is one
        return orjson.dumps(encodable(value), default=default, option=option)


def clean_text(text: str) -> str:
    """`text`, or when it holds lone surrogates, with U+FFFD in their place."""
    if text.isascii():  # constant time in CPython
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        try:  # surrogates that stand for bytes (surrogateescape): those bytes, then U+FFFD
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:
            return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def encodable(value: Any, depth: int = 0) -> Any:
    """A copy orjson can encode: strings repaired, integers it cannot write as text, and
    containers below `MAX_DEPTH` replaced by `TOO_DEEP`. Dataclasses become their fields,
    as orjson writes them; other values are left to the encoder (and its `default`)."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        return value if value in _INT_RANGE else str(value)
    is_dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
    if not isinstance(value, (dict, list, tuple)) and not is_dataclass:
        return value
    if depth >= MAX_DEPTH:
        return TOO_DEEP
    if is_dataclass:
        return {
            f.name: encodable(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)
        }
    if isinstance(value, dict):
        return {
            clean_text(k) if isinstance(k, str) else k: encodable(v, depth + 1)
            for k, v in value.items()
        }
    return [encodable(item, depth + 1) for item in value]
