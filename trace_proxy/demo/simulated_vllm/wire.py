"""What both simulated servers write with: compact JSON, stable ids, the fixed `created`.

Both real servers are FastAPI apps writing compact JSON; deterministic mode needs ids and a
`created` that depend on the request alone, so two runs can be compared byte for byte.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import orjson
from aiohttp import web

FIXED_CREATED = 1763800000  # `created` of every response in deterministic mode
DEFAULT_MAX_MODEL_LEN = 32768

JSON = dict[str, Any]


def dumps(obj: Any) -> bytes:
    """Compact JSON, the shape both FastAPI servers emit (`separators=(",", ":")`)."""
    return orjson.dumps(obj)


def hex_digest(*parts: bytes | str, size: int = 8) -> str:
    """A short stable hex digest (2*size chars) of the parts."""
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\x00")
    return h.hexdigest()


def random_uuid() -> str:
    """vLLM's `random_uuid()`: 16 hex chars."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json")
