"""Names a request chose, as file names: each value becomes one safe path component.

A project or experiment comes from a header, baggage, the path prefix, a body mapping or the
admin port's `/rewards`, and the store keeps records in a directory named after it. Joined into
a path as it is, `../..`, `/etc` or `a/b` would put files outside the store, so every such
value goes through `store_name`: deterministic, injective, and always one component.

- ASCII letters, digits and `-_.+=@` are kept, so ordinary names stay readable
  (`Qwen3-8B-grpo`); every other UTF-8 byte is written `%XX` (upper-case hex): `%` itself,
  `/`, `\\`, NUL, control characters, spaces and all non-ASCII. Names are then plain ASCII, so
  a filesystem that normalises unicode (macOS) cannot merge two of them.
- A leading `.` is written `%2E`: no name is `.`, `..` or hidden (the spool is `.spool`).
- The empty value is `%`, which no other value gives (a `%` is always followed by two hex
  digits otherwise).
- A name longer than `MAX_NAME` characters (well under the usual 255-byte limit, leaving room
  for a suffix) is cut and ends with `~` and a hash of the whole value; `~` is never kept, so it
  only marks a shortened (or, in the store, disambiguated) name. `decode_name` reverses the rest.

Names that differ only in case stay distinct here; on a case-insensitive filesystem they would
share a directory, which the store resolves itself (see `trace_proxy/store/layout.py`).
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterator
from typing import Any

from trace_proxy.trajectories.keys import MAX_VALUE_LEN
from trace_proxy.trajectories.record import RolloutKey

KEPT = frozenset(string.ascii_letters + string.digits + "-_.+=@")
EMPTY = "%"
MARK = "~"  # outside KEPT: only a shortened or disambiguated name contains it
HASH_CHARS = 32
MAX_NAME = 150
_CUT = MAX_NAME - len(MARK) - HASH_CHARS
_HEX = frozenset("0123456789ABCDEF")


def digest(value: str) -> str:
    """A hash of the whole value (128 bits, hex): what tells shortened names apart."""
    raw = value.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=HASH_CHARS // 2).hexdigest()


def encode_name(value: str) -> str:
    """`value` with every byte outside the kept set written `%XX`, unshortened."""
    return "".join(_pieces(value)) or EMPTY


def store_name(value: str) -> str:
    """The one path component `value` is stored under (see the module's docstring)."""
    name = encode_name(value)
    if len(name) <= MAX_NAME:
        return name
    prefix, size = [], 0
    for piece in _pieces(value):  # whole characters: the prefix reads as the value's start
        size += len(piece)
        if size > _CUT:
            break
        prefix.append(piece)
    return "".join(prefix) + MARK + digest(value)


def _pieces(value: str) -> Iterator[str]:
    """Each character as it is written in a name."""
    for position, char in enumerate(value):
        if char in KEPT and not (position == 0 and char == "."):
            yield char
        else:  # any str, lone surrogates included
            yield "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))


def decode_name(name: str) -> str | None:
    """The value `name` was made from; None for a shortened name (it keeps only a hash of the
    rest) or for anything `store_name` does not produce."""
    if name == EMPTY:
        return ""
    raw = bytearray()
    position = 0
    while position < len(name):
        char = name[position]
        if char == "%":
            pair = name[position + 1 : position + 3]
            if len(pair) != 2 or not set(pair) <= _HEX:
                return None
            raw.append(int(pair, 16))
            position += 3
        elif char in KEPT:
            raw.append(ord(char))
            position += 1
        else:
            return None
    try:
        value = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return value if encode_name(value) == name else None


def is_safe_component(name: str) -> bool:
    """One name in a directory, and not `.`, `..` or hidden: what every name given to the
    filesystem must be (checked again where a path is built)."""
    return (
        0 < len(name.encode("utf-8", "surrogatepass")) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\x00")
    )


def store_name_notes(key: RolloutKey) -> list[dict[str, Any]]:
    """A note for each of project and experiment whose directory in the store is not named as
    the value (`store_name`): the key keeps the value as it was sent."""
    notes = []
    for field_name in ("project", "experiment"):
        value: str = getattr(key, field_name)
        stored = store_name(value)
        if stored != value:
            notes.append({"field": field_name, "source": key.sources.get(field_name, "config"),
                          "value": value[:MAX_VALUE_LEN], "stored_as": stored})  # fmt: skip
    return notes
