"""The upstream HTTP/1.1 client, through the running proxy, against byte-scripted upstreams.

A raw TCP server writes exactly the bytes each test needs (HEAD answers that announce a body,
1xx before the final answer, a body that ends with the connection, a stale keep-alive socket),
so each case is the upstream behaviour itself rather than what a server library would send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from support.proxies import all_calls, running_proxy

from trace_proxy.proxy.headers import upstream_request_fields
from trace_proxy.proxy.upstream_client import (
    READ_HIGH_WATER,
    UpstreamClient,
    UpstreamConnection,
)

GUARD = 20  # seconds: a failure bound, not a synchronisation
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_upstream(script: Script) -> AsyncIterator[str]:
    """Runs `script(reader, writer, n)` for the n-th accepted connection (from 0)."""
    accepted = 0

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        index, accepted = accepted, accepted + 1
        try:
            await script(reader, writer, index)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def proxied(
    script: Script, output: Path, **overrides: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """A proxy in front of a raw upstream running `script`, and a client session for it."""
    async with (
        raw_upstream(script) as up,
        running_proxy([up], output, **overrides) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        yield proxy, session


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One request as the upstream receives it: request line, headers, body (by length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head.decode().split("\r\n")[:-2]
    headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return line, headers, body


async def test_sequential_requests_share_one_keep_alive_connection(tmp_path: Path) -> None:
    per_connection: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        per_connection.append(0)
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            per_connection[n] += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async with proxied(script, tmp_path) as (proxy, session):
        for _ in range(5):
            async with session.get(proxy + "/health") as resp:
                assert await resp.read() == b"ok"
    assert per_connection == [5]


async def test_a_keep_alive_connection_closed_while_idle_is_retried_on_a_new_one(
    tmp_path: Path,
) -> None:
    """The upstream's keep-alive timeout races the next request: the request must not fail."""
    received: list[tuple[int, bytes]] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        _, _, body = await read_request(reader)
        received.append((n, body))
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
            await writer.drain()
            _, _, body = await read_request(reader)  # read, then closed unanswered
            received.append((n, body))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):
        first, second = orjson.dumps({"prompt": [1]}), orjson.dumps({"prompt": [2]})
        async with session.post(proxy + "/v1/completions", data=first) as resp:
            assert await resp.read() == b"first"
        async with session.post(proxy + "/v1/completions", data=second) as resp:
            assert resp.status == 200
            assert await resp.read() == b"second"
    assert received == [(0, first), (0, second), (1, second)]


async def test_head_answer_announcing_a_body_ends_at_its_headers(tmp_path: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        line, _, _ = await read_request(reader)
        assert line.startswith("HEAD ")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\nX-Kind: head\r\n\r\n")
        line, _, _ = await read_request(reader)  # the same connection serves the next one
        assert line.startswith("GET ")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nget")
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):

        async def head_then_get() -> None:
            async with session.head(proxy + "/file") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Length"] == "42"
                assert resp.headers["X-Kind"] == "head"
            async with session.get(proxy + "/file") as resp:
                assert await resp.read() == b"get"

        await asyncio.wait_for(head_then_get(), GUARD)


async def test_informational_answers_are_skipped_and_the_final_one_forwarded(
    tmp_path: Path,
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
            b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone"
        )
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):
        async with session.post(proxy + "/items", data=b"x") as resp:
            assert resp.status == 201
            assert await resp.read() == b"done"
            assert "Link" not in resp.headers


async def test_a_body_that_ends_with_the_connection_is_complete_and_recorded(
    tmp_path: Path,
) -> None:
    answer = b'{"text": ["an answer without a length"]}'

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        writer.write(answer[:10])
        await writer.drain()
        writer.write(answer[10:])  # then the connection closes: that is the end of the body

    async with proxied(script, tmp_path) as (proxy, session):
        async with session.post(proxy + "/generate", json={"input_ids": [1, 2]}) as resp:
            assert resp.status == 200
            assert await resp.read() == answer
    [call] = all_calls(tmp_path)
    assert call["http_status"] == 200 and call["error"] is None
    assert call["outputs"][0]["text"] == ["an answer without a length"]


async def test_chunked_answer_reaches_client_exactly_and_the_record_de_chunked(
    tmp_path: Path,
) -> None:
    events = [b'data: {"text": "a", "meta_info": {}}\n\n', b"data: [DONE]\n\n"]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for event in events:  # an extension and odd split points, as the grammar allows
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\nX-Trailer: t\r\n\r\n")
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):
        body = {"text": "hi", "stream": True}
        async with session.post(proxy + "/generate", json=body) as resp:
            assert await resp.read() == b"".join(events)
    [call] = all_calls(tmp_path)
    assert call["error"] is None and call["outputs"][0]["text"] == "a"


async def test_the_reason_phrase_is_forwarded(tmp_path: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 429 Slow Down Please\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):
        async with session.get(proxy + "/x") as resp:
            assert resp.status == 429 and resp.reason == "Slow Down Please"


async def test_an_invalid_answer_is_502_and_recorded(tmp_path: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()

    async with proxied(script, tmp_path) as (proxy, session):
        async with session.post(proxy + "/generate", json={"text": "x"}) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
    assert error["type"] == "upstream_reset" and "invalid HTTP response" in error["message"]
    [call] = all_calls(tmp_path)
    assert call["http_status"] == 502


async def test_connection_close_answers_are_not_reused(tmp_path: Path) -> None:
    connections: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        connections.append(n)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # held open: only the proxy's close ends it

    async with proxied(script, tmp_path) as (proxy, session):
        for _ in range(3):
            async with session.get(proxy + "/x") as resp:
                assert await resp.read() == b"ok"
    assert connections == [0, 1, 2]


class _RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.written: list[bytes] = []
        self.wrote = asyncio.Event()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))
        self.wrote.set()

    def abort(self) -> None:
        pass


async def test_a_slow_client_pauses_the_upstream_socket_until_it_reads() -> None:
    client = UpstreamClient(connect_timeout=1, read_timeout=None)
    connection = UpstreamConnection(client, ("127.0.0.1", 1, False))
    transport = _RecordingTransport()
    connection.connection_made(transport)
    request = b"GET / HTTP/1.1\r\nHost: up\r\n\r\n"
    sending = asyncio.ensure_future(connection.send(request, None, False, False, None))
    await transport.wrote.wait()
    assert transport.written == [request]
    connection.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await sending
    chunk = b"x" * 65536
    fed = 0
    while not transport.paused:
        connection.data_received(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        fed += len(chunk)
        assert fed <= READ_HIGH_WATER + len(chunk), "never paused"
    data = await connection.read()
    assert len(data) == fed and not transport.paused
    connection.data_received(b"0\r\n\r\n")
    assert await connection.read() == b""
    await client.close()


@pytest.mark.parametrize("silent_after_bytes", [False, True])
async def test_read_timeout_counts_silence_not_total_time(
    tmp_path: Path, silent_after_bytes: bool
) -> None:
    """Data keeps a slow answer alive; silence past the timeout ends it (504 or a cut)."""
    done = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        if not silent_after_bytes:
            for _ in range(10):
                writer.write(b"0123456789")
                await writer.drain()
                await asyncio.sleep(0.1)  # pacing under test, not synchronisation
        await done.wait()

    async with proxied(script, tmp_path, read_timeout=0.5) as (proxy, session):
        async with session.get(proxy + "/slow") as resp:
            if silent_after_bytes:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(resp.read(), GUARD)
            else:
                assert len(await asyncio.wait_for(resp.read(), GUARD)) == 100
        done.set()


def test_request_fields_drop_hop_by_hop_and_extend_forwarded_for() -> None:
    raw = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive, X-Drop-Me"),
        (b"X-Drop-Me", b"listed in Connection"),
        (b"X-Forwarded-For", b"10.0.0.1"),
        (b"te", b"trailers"),
        (b"Host", b"proxy:8000"),
        (b"x-forwarded-for", b"10.0.0.2"),
        (b"X-Forwarded-Proto", b"https"),
        (b"Authorization", b"Bearer sk-forward-me"),
    ]
    fields = upstream_request_fields(raw, "127.0.0.1", "http", "proxy:8000")
    assert fields == [
        (b"Content-Type", b"application/json"),
        (b"X-Forwarded-Proto", b"https"),  # the client's own, kept
        (b"Authorization", b"Bearer sk-forward-me"),
        (b"X-Forwarded-For", b"10.0.0.1, 10.0.0.2, 127.0.0.1"),
        (b"X-Forwarded-Host", b"proxy:8000"),
    ]
