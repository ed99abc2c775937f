"""How exchanges and control messages travel from a forwarding process to the capture process.

One stream socket, frames in order: a fixed head (kind, then the lengths of a JSON part and of
two raw parts), the JSON part, the request body, the response body. Bodies are never encoded,
only copied, so the forwarding side spends microseconds per exchange whatever the prompt's
length; everything that costs (JSON decoding of token ids) happens on the other side.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy import safejson
from trace_proxy.capture.exchange import Exchange

HEAD = struct.Struct("!BIQQ")  # kind, JSON length, request body length, response body length
EXCHANGE = 1
CONTROL = 2


def encode_exchange(exchange: Exchange) -> list[bytes]:
    """The frame of one finished exchange, as buffers to write in order (bodies not copied)."""
    response_headers = exchange.response_headers
    meta = safejson.dumps(  # headers and paths may hold bytes that are not UTF-8
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
            exchange.dropped,
            exchange.bodies_skipped,
        )
    )
    chunks = exchange.response_chunks
    response = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request = exchange.request_body
    return [HEAD.pack(EXCHANGE, len(meta), len(request), len(response)), meta, request, response]


def decode_exchange(meta: bytes, request: bytes, response: bytes) -> Exchange:
    (
        method, path, query, request_headers, path_metadata, upstream, start, status,
        response_headers, first_byte, end, error, tool_route, admitted, dropped, skipped,
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
        dropped=dropped,
        bodies_skipped=skipped,
    )


def encode_control(message: dict[str, Any]) -> bytes:
    meta = safejson.dumps(message)
    return HEAD.pack(CONTROL, len(meta), 0, 0) + meta


Frame = Exchange | dict[str, Any]


class FrameReader(asyncio.Protocol):
    """Frames as they arrive on the socket. Each body is copied once out of the bytes read
    (a StreamReader copies it several times, and moves its buffer for every frame taken);
    reading pauses while more than `max_waiting` frames wait for the consumer, so a consumer
    that lags pushes back on the writer."""

    def __init__(self, max_waiting: int = 64) -> None:
        self._chunks: list[bytes] = []  # the start of a frame, not yet complete
        self._buffered = 0
        self._head: tuple[int, int, int, int] | None = None
        self._need = HEAD.size
        self._frames: deque[Frame] = deque()
        self._max_waiting = max_waiting
        self._waiter: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._ended = False
        self._error: Exception | None = None
        self.closed: asyncio.Future[None]  # done once the connection is closed

    @property
    def transport(self) -> asyncio.Transport:
        assert self._transport is not None
        return self._transport

    @property
    def waiting(self) -> int:
        """Frames read and not yet taken."""
        return len(self._frames)

    async def next(self) -> Frame:
        """The next frame. EOFError at the end of the stream; ValueError after a frame that
        is not ours (the connection is closed then)."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise EOFError
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        frame = self._frames.popleft()
        if self._paused and len(self._frames) <= self._max_waiting // 2:
            self._paused = False
            self.transport.resume_reading()
        return frame

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered < self._need:
            return  # most reads of a long body: nothing to join yet
        buffer = data if len(self._chunks) == 1 else b"".join(self._chunks)
        offset = 0
        try:
            while len(buffer) - offset >= self._need:
                if self._head is None:
                    self._head = HEAD.unpack_from(buffer, offset)
                    offset += HEAD.size
                    _, meta, request, response = self._head
                    if meta == 0:
                        raise ValueError("a frame without its JSON part")
                    self._need = meta + request + response
                else:
                    self._frames.append(_frame(buffer, offset, *self._head))
                    offset += self._need
                    self._head, self._need = None, HEAD.size
        except (ValueError, orjson.JSONDecodeError) as exc:
            self._error = ValueError(f"not a capture frame: {exc}")
            self.transport.close()
        rest = buffer[offset:] if offset else buffer
        self._chunks = [rest] if rest else []
        self._buffered = len(rest)
        self._wake()
        if not self._paused and len(self._frames) > self._max_waiting:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._ended = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._wake()
        if not self.closed.done():
            self.closed.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _frame(buffer: bytes, offset: int, kind: int, meta: int, request: int, response: int) -> Frame:
    meta_end = offset + meta
    if kind == CONTROL:
        message = orjson.loads(buffer[offset:meta_end])
        if not isinstance(message, dict):
            raise ValueError("a control frame that is not a JSON object")
        return message
    if kind != EXCHANGE:
        raise ValueError(f"unknown frame kind {kind}")
    request_end = meta_end + request
    return decode_exchange(
        buffer[offset:meta_end],
        buffer[meta_end:request_end] if request else b"",
        buffer[request_end : request_end + response] if response else b"",
    )
