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


SCRATCH_BYTES = 256 << 10  # what one read may take of frames that are not read apart
OWN_BUFFER_FROM = 64 << 10  # a frame this long (after its head) is read into a buffer of its own


class FrameReader(asyncio.BufferedProtocol):
    """Frames as they arrive on the socket, read by the kernel straight into our buffers: small
    frames into one reused scratch buffer, many per read; the rest of a frame of
    `own_buffer_from` bytes or more (what the scratch buffer does not hold of it already) into
    a buffer of that frame's size, so a long prompt is never joined from reads (with a plain
    Protocol every read was a new bytes object, a frame spread over reads was joined, and then
    cut into its parts: three copies of each body; now one, into the bytes the exchange holds).
    Reading pauses while more than `max_waiting` frames wait for the consumer, so a consumer
    that lags pushes back on the writer."""

    def __init__(self, max_waiting: int = 64, own_buffer_from: int = OWN_BUFFER_FROM) -> None:
        self._scratch = bytearray(max(SCRATCH_BYTES, 2 * own_buffer_from))
        self._view = memoryview(self._scratch)
        self._start = 0  # scratch[start:end] is read and not yet taken apart
        self._end = 0
        self._own_buffer_from = own_buffer_from
        self._head: tuple[int, int, int, int] | None = None  # of the frame being read
        self._own: bytearray | None = None  # the frame being read into a buffer of its own
        self._own_filled = 0
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

    def get_buffer(self, sizehint: int) -> memoryview:
        own = self._own
        if own is not None:
            return memoryview(own)[self._own_filled :]
        if self._start and len(self._scratch) - self._end < self._own_buffer_from:
            # What is left of a frame moves to the front: it is shorter than
            # `own_buffer_from`, so the scratch then has room for the rest of it.
            left = self._end - self._start
            self._view[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._own is not None:
                self._own_filled += nbytes
                if self._own_filled == len(self._own):
                    own, self._own = self._own, None
                    self._frames.append(_frame(own, 0, *self._take_head()))
            else:
                self._end += nbytes
                self._take_frames()
        except (ValueError, orjson.JSONDecodeError) as exc:
            self._error = ValueError(f"not a capture frame: {exc}")
            self._start = self._end = 0
            self._own = None
            self.transport.close()
        self._wake()
        if not self._paused and len(self._frames) > self._max_waiting:
            self._paused = True
            self.transport.pause_reading()

    def feed(self, data: bytes) -> None:
        """Hand over bytes as the event loop would have read them (for tests and tools)."""
        offset = 0
        while offset < len(data):
            buffer = self.get_buffer(-1)
            taken = min(len(buffer), len(data) - offset)
            buffer[:taken] = data[offset : offset + taken]
            offset += taken
            self.buffer_updated(taken)

    def _take_frames(self) -> None:
        """Every whole frame in the scratch buffer; a long one's start goes to its own."""
        view, start, end = self._view, self._start, self._end
        while True:
            if self._head is None:
                if end - start < HEAD.size:
                    break
                self._head = head = HEAD.unpack_from(view, start)
                start += HEAD.size
                _, meta, request, response = head
                if meta == 0:
                    raise ValueError("a frame without its JSON part")
                need = meta + request + response
                if need >= self._own_buffer_from and end - start < need:
                    self._own = own = bytearray(need)
                    have = end - start  # less than it needs: the rest goes straight there
                    own[:have] = view[start:end]
                    start += have
                    self._own_filled = have
                    break
            kind, meta, request, response = self._head
            need = meta + request + response
            if end - start < need:
                break
            self._frames.append(_frame(view, start, kind, meta, request, response))
            self._head = None
            start += need
        if start == end:
            start = end = 0
        self._start, self._end = start, end

    def _take_head(self) -> tuple[int, int, int, int]:
        head, self._head = self._head, None
        assert head is not None
        return head

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


def _frame(
    buffer: bytearray | memoryview, offset: int, kind: int, meta: int, request: int, response: int
) -> Frame:
    """A frame out of a buffer that is reused or written to again: its parts copied out once."""
    buffer = memoryview(buffer)  # slices of a view are not copies
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
        bytes(buffer[offset:meta_end]),
        bytes(buffer[meta_end:request_end]) if request else b"",
        bytes(buffer[request_end : request_end + response]) if response else b"",
    )
