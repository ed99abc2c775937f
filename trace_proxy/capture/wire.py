"""How exchanges and control messages travel from a forwarding process to the capture process.

One stream socket, frames in order: a fixed head (kind, then the lengths of a JSON part and of
two raw parts), the JSON part, the request body, the response body. Bodies are never encoded,
only copied, so the forwarding side spends microseconds per exchange whatever the prompt's
length; everything that costs (JSON decoding of token ids) happens on the other side.
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import sys
import termios
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
    return exchange_of(orjson.loads(meta), request, response)


def exchange_of(meta: list[Any], request: bytes, response: bytes) -> Exchange:
    """An exchange from its decoded JSON part (`encode_exchange`'s tuple) and its bodies."""
    (
        method, path, query, request_headers, path_metadata, upstream, start, status,
        response_headers, first_byte, end, error, tool_route, admitted, dropped, skipped,
    ) = meta  # fmt: skip
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


DROPPED_AT = 14  # where `dropped` is in the JSON part


class LongFrame:
    """An exchange's frame read into a buffer of its own and not taken apart yet (see
    `FrameReader`'s `defer_long`): while exchanges wait on disk it goes there as it came
    (`overflow.py`), with no copy of its bodies and no decoding; else `decode` makes it the
    exchange."""

    __slots__ = ("_meta", "buffer", "head")

    def __init__(self, head: tuple[int, int, int, int], buffer: bytearray) -> None:
        self.head = head  # kind, JSON length, request body length, response body length
        self.buffer = buffer  # the JSON part and both bodies, as they follow the head
        self._meta: list[Any] | None = None

    @property
    def size(self) -> int:
        """Body bytes (what the exchange weighs in the capture queue)."""
        return self.head[2] + self.head[3]

    @property
    def dropped(self) -> str | None:
        """Why the forwarder kept no bodies (see `Exchange.dropped`); None for most."""
        dropped: str | None = self._decoded_meta()[DROPPED_AT]
        return dropped

    def parts(self) -> list[bytes | bytearray]:
        """The frame as it crossed the socket, as buffers to write in order (not copied)."""
        return [HEAD.pack(*self.head), self.buffer]

    def decode(self) -> Exchange:
        """ValueError when the frame is not one of ours."""
        _, meta, request, response = self.head
        view = memoryview(self.buffer)
        request_end = meta + request
        return exchange_of(
            self._decoded_meta(),
            bytes(view[meta:request_end]) if request else b"",
            bytes(view[request_end : request_end + response]) if response else b"",
        )

    def _decoded_meta(self) -> list[Any]:
        if self._meta is None:
            meta = orjson.loads(memoryview(self.buffer)[: self.head[1]])
            if not isinstance(meta, list) or len(meta) <= DROPPED_AT:
                raise ValueError("an exchange's JSON part that is not one")
            self._meta = meta
        return self._meta


Frame = Exchange | dict[str, Any] | LongFrame


SCRATCH_BYTES = 256 << 10  # what one read may take of frames that are not read apart
OWN_BUFFER_FROM = 64 << 10  # a frame this long (after its head) is read into a buffer of its own
# Long frames' buffers kept for the next ones: as many as wait to be taken in a burst (up to
# `max_waiting` frames of 400 kB at 32k-token prompts).
SPARE_BYTES = 32 << 20


class FrameReader(asyncio.BufferedProtocol):
    """Frames as they arrive on the socket, read by the kernel straight into our buffers: small
    frames into one reused scratch buffer, many per read; the rest of a frame of
    `own_buffer_from` bytes or more (what the scratch buffer does not hold of it already) into
    a buffer of that frame's size, so a long prompt is never joined from reads (with a plain
    Protocol every read was a new bytes object, a frame spread over reads was joined, and then
    cut into its parts: three copies of each body; now one, into the bytes the exchange holds).
    Reading pauses while more than `max_waiting` frames wait for the consumer, so a consumer
    that lags pushes back on the writer. A long frame's buffer given back (`give_back`) is
    read into again: a new one is zeroed first, as costly as reading it."""

    def __init__(
        self,
        max_waiting: int = 64,
        own_buffer_from: int = OWN_BUFFER_FROM,
        *,
        defer_long: bool = False,
    ) -> None:
        """`defer_long`: an exchange read into a buffer of its own comes as a `LongFrame`,
        decoded by the consumer only if it needs the exchange (the capture process)."""
        self._scratch = bytearray(max(SCRATCH_BYTES, 2 * own_buffer_from))
        self._view = memoryview(self._scratch)
        self._start = 0  # scratch[start:end] is read and not yet taken apart
        self._end = 0
        self._own_buffer_from = own_buffer_from
        self._defer_long = defer_long
        self._head: tuple[int, int, int, int] | None = None  # of the frame being read
        self._own: bytearray | None = None  # the frame being read into a buffer of its own
        self._own_filled = 0
        self._spare: deque[bytearray] = deque()  # long frames' buffers given back
        self._spare_bytes = 0
        self._frames: deque[Frame] = deque()
        self._max_waiting = max_waiting
        self._waiter: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._fd: int | None = None  # the socket's, for `unread`
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
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else None

    def unread(self) -> bool:
        """Are frames waiting to be taken, or bytes to be read? (One system call: the
        capture stage asks it between exchanges while it is behind.)"""
        if self._frames:
            return True
        if self._fd is None or self._ended or self._paused:
            return False
        try:
            waiting = fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return False
        return bool(int.from_bytes(waiting, sys.byteorder))

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
                    head = self._take_head()
                    if self._defer_long and head[0] == EXCHANGE:
                        self._frames.append(LongFrame(head, own))
                    else:
                        self._frames.append(_frame(own, 0, *head))
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
                    self._own = own = self._new_own(need)
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

    def _new_own(self, need: int) -> bytearray:
        """A buffer for a long frame: the last one given back, made the size needed. A new
        one is zeroed, which cost as much as reading the frame into it (45 µs for the 400 kB
        of a 32k-token prompt's); a bytearray cut by less than half keeps its memory, so
        growing it back zeroes only what it grows by."""
        spare = self._spare
        while spare:
            buffer = spare.pop()
            self._spare_bytes -= len(buffer)
            grow = need - len(buffer)
            if grow > need // 4:
                continue  # as costly as a new one
            try:
                if grow <= 0:
                    del buffer[need:]
                else:
                    buffer += bytes(grow)
            except BufferError:  # still viewed: left to the collector
                continue
            return buffer
        return bytearray(need)

    def give_back(self, buffer: bytearray) -> None:
        """A `LongFrame`'s buffer once its frame is written to disk or decoded: the next long
        frame is read into it."""
        spare = self._spare
        spare.append(buffer)
        self._spare_bytes += len(buffer)
        while self._spare_bytes > SPARE_BYTES:
            self._spare_bytes -= len(spare.popleft())

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
