"""Exchanges waiting to be parsed beyond the capture queue's memory: on disk, in arrival order.

On a core that forwarding keeps busy, parsing falls behind. Rollouts come in bursts (generation,
then training), so what parsing cannot keep up with during a burst can wait and be parsed after
it, instead of being dropped once the memory budget is full. Here it waits as the frames it
crossed the socket in (`wire.py`): appending one costs a copy to the page cache, not a parse.
The file has no name (it goes with the process) and lies in the spool's directory; it is cut
back to nothing whenever everything in it has been read, and never grows past its budget.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.wire import (
    EXCHANGE,
    HEAD,
    LongFrame,
    decode_exchange,
    encode_exchange,
)


class OverflowLost(OSError):
    """The overflow file cannot be read back: what it holds is lost."""


class Overflow:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self._directory = directory
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._write_at = 0  # the file's end
        self._read_at = 0  # the next frame's start
        self._next: tuple[int, int, int] | None = None  # the next frame's lengths, once read
        self.count = 0  # exchanges in the file, not read yet

    @property
    def disk_bytes(self) -> int:
        """The file's size (what it holds and what was read but not cut back yet)."""
        return self._write_at

    def append(self, exchange: Exchange | LongFrame) -> bool:
        """False when the budget has no room for it; OSError when the disk refuses (nothing
        is counted as held then). A long frame is written as it came, not encoded again."""
        frame = exchange.parts() if isinstance(exchange, LongFrame) else encode_exchange(exchange)
        length = sum(map(len, frame))
        if self._write_at + length > self.max_bytes:
            return False
        if self._fd is None:
            self._directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self._directory) as file:
                self._fd = os.dup(file.fileno())
        written = os.pwritev(self._fd, frame, self._write_at)
        if written != length:  # a full disk can take part of it: never counted
            raise OSError(f"the disk took {written} of {length} bytes")
        self._write_at += length
        self.count += 1
        return True

    def next_size(self) -> int:
        """Body bytes of the next exchange (what it will weigh in the memory queue)."""
        _, request, response = self._peek()
        return request + response

    def pop(self) -> Exchange:
        """The oldest exchange (OverflowLost when it cannot be read)."""
        meta_length, request_length, response_length = self._peek()
        at = self._read_at + HEAD.size
        meta = self._read(meta_length, at)
        request = self._read(request_length, at + meta_length)
        response = self._read(response_length, at + meta_length + request_length)
        self._advance(HEAD.size + meta_length + request_length + response_length)
        exchange = _decoded(meta, request, response)
        exchange.size = request_length + response_length
        return exchange

    def pop_head(self) -> Exchange:
        """The oldest exchange without its bodies, which are not read (what is left at the
        end becomes the marks of dropped calls)."""
        meta_length, request_length, response_length = self._peek()
        meta = self._read(meta_length, self._read_at + HEAD.size)
        self._advance(HEAD.size + meta_length + request_length + response_length)
        return _decoded(meta, b"", b"")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._write_at = self._read_at = self.count = 0
        self._next = None

    def _peek(self) -> tuple[int, int, int]:
        if self._next is None:
            if not self.count:
                raise IndexError("the overflow is empty")
            kind, meta, request, response = HEAD.unpack(self._read(HEAD.size, self._read_at))
            if kind != EXCHANGE:
                raise OverflowLost(f"the overflow file is damaged at byte {self._read_at}")
            self._next = (meta, request, response)
        return self._next

    def _read(self, length: int, at: int) -> bytes:
        assert self._fd is not None
        try:
            data = os.pread(self._fd, length, at)
        except OSError as exc:
            raise OverflowLost(f"the overflow file cannot be read: {exc}") from None
        if len(data) != length:
            raise OverflowLost(f"the overflow file ends at byte {at + len(data)}")
        return data

    def _advance(self, length: int) -> None:
        self._read_at += length
        self._next = None
        self.count -= 1
        if not self.count:  # all read: the file is cut back, its blocks freed
            assert self._fd is not None
            with contextlib.suppress(OSError):  # else it goes on from where it is
                os.ftruncate(self._fd, 0)
                self._write_at = self._read_at = 0


def _decoded(meta: bytes, request: bytes, response: bytes) -> Exchange:
    try:
        return decode_exchange(meta, request, response)
    except (ValueError, TypeError) as exc:  # what we wrote ourselves: the file is damaged
        raise OverflowLost(f"the overflow file is damaged: {exc}") from None
