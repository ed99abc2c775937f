"""How exchanges and control messages travel from a forwarding process to the capture process.

One stream socket, frames in order: a fixed head (kind, then the lengths of a JSON part and of
two raw parts), the JSON part, the request body, the response body. Bodies are never encoded,
only copied, so the forwarding side spends microseconds per exchange whatever the prompt's
length; everything that costs (JSON decoding of token ids) happens on the other side.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.exchange import Exchange

HEAD = struct.Struct("!BIQQ")  # kind, JSON length, request body length, response body length
EXCHANGE = 1
CONTROL = 2


def encode_exchange(exchange: Exchange) -> list[bytes]:
    """The frame of one finished exchange, as buffers to write in order (bodies not copied)."""
    response_headers = exchange.response_headers
    meta = orjson.dumps(
        (
            exchange.method,
            exchange.path,
            exchange.query,
            list(exchange.request_headers.items()),
            exchange.path_metadata,
            exchange.upstream,
            exchange.start,
            exchange.status,
            None if response_headers is None else list(response_headers.items()),
            exchange.first_byte,
            exchange.end,
            exchange.error,
            exchange.tool_route,
            exchange.admitted,
        )
    )
    chunks = exchange.response_chunks
    response = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request = exchange.request_body
    return [HEAD.pack(EXCHANGE, len(meta), len(request), len(response)), meta, request, response]


def decode_exchange(meta: bytes, request: bytes, response: bytes) -> Exchange:
    (
        method, path, query, request_headers, path_metadata, upstream, start, status,
        response_headers, first_byte, end, error, tool_route, admitted,
    ) = orjson.loads(meta)  # fmt: skip
    return Exchange(
        method=method,
        path=path,
        query=query,
        request_headers=CIMultiDictProxy(CIMultiDict(request_headers)),
        path_metadata=[(key, value) for key, value in path_metadata],
        upstream=upstream,
        start=start,
        request_body=request,
        status=status,
        response_headers=None if response_headers is None else CIMultiDict(response_headers),
        response_chunks=[response] if response else [],
        first_byte=first_byte,
        end=end,
        error=error,
        tool_route=tool_route,
        admitted=admitted,
    )


def encode_control(message: dict[str, Any]) -> bytes:
    meta = orjson.dumps(message)
    return HEAD.pack(CONTROL, len(meta), 0, 0) + meta


async def read_frame(reader: asyncio.StreamReader) -> Exchange | dict[str, Any]:
    """The next frame: an exchange or a control message. Raises IncompleteReadError at the end
    of the stream, ValueError on a frame that is not ours."""
    kind, meta_length, request_length, response_length = HEAD.unpack(
        await reader.readexactly(HEAD.size)
    )
    meta = await reader.readexactly(meta_length)
    if kind == CONTROL:
        message = orjson.loads(meta)
        if not isinstance(message, dict):
            raise ValueError("a control frame that is not a JSON object")
        return message
    if kind != EXCHANGE:
        raise ValueError(f"unknown frame kind {kind}")
    request = await reader.readexactly(request_length) if request_length else b""
    response = await reader.readexactly(response_length) if response_length else b""
    return decode_exchange(meta, request, response)
