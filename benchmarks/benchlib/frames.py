"""The benchmark workload as the capture process receives it: exchanges framed as the forwarder
frames them, sent over a socket pair with the proxy's buffer sizes (intake.py,
capture_stages.py)."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from benchlib.workload import PATH, build_turns, rollout_headers
from trace_proxy.capture import wire
from trace_proxy.capture.exchange import Exchange
from trace_proxy.processes.capture import SOCKET_BUFFER

SAMPLES = 64  # distinct rollouts a step; the step changes every SAMPLES trajectories


def exchange(turns: list[Any], index: int) -> Exchange:
    """The `index`th exchange sent: turn `index % 4` of a rollout, steps moving on."""
    turn = turns[index % 4]
    rollout = index // 4
    headers = rollout_headers(1 + rollout // SAMPLES, rollout % SAMPLES, index % 4 == 3)
    return Exchange(
        method="POST", path=PATH, query="", request_headers=CIMultiDictProxy(
            CIMultiDict(headers)), path_metadata=[], upstream="http://127.0.0.1:9",
        start=1000.0 + index, request_body=turn.request, status=200,
        response_headers=CIMultiDict({"Content-Type": turn.content_type}),
        response_chunks=[turn.response], first_byte=1000.0 + index, end=1000.0 + index,
    )  # fmt: skip


def write_all(sock: socket.socket, prompt_tokens: int, count: int) -> None:
    """`count` exchanges, as fast as the reader takes them, then the end of the stream."""
    turns = build_turns(4, False, 1, prompt_tokens)
    for index in range(count):
        sock.sendall(b"".join(wire.encode_exchange(exchange(turns, index))))  # no drops here
    sock.close()


def capture_socket() -> tuple[socket.socket, socket.socket]:
    """The reader's end and the writer's, with the kernel buffers the proxy gives them."""
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    return ours, theirs


@contextmanager
def sent_by_another_process(prompt_tokens: int, count: int) -> Iterator[socket.socket]:
    """The reader's end of a capture socket that a forked process sends `count` exchanges to."""
    ours, theirs = capture_socket()
    writer = multiprocessing.get_context("fork").Process(
        target=write_all, args=(theirs, prompt_tokens, count)
    )
    writer.start()
    theirs.close()
    try:
        yield ours
    finally:
        ours.close()  # a reader that stopped early must not leave the writer blocked
        writer.join()
