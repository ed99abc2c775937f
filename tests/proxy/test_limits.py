"""The limits a client meets: time to send a request, size of its head, bodies too large to
record, and the admin port's token.

Slow clients are played over raw sockets, sending slowly on purpose; every cut is awaited with
a deadline, never assumed after a sleep.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from support.proxies import all_calls, events, metric, running_proxy, scripted_upstream

GUARD = 20.0  # seconds: a failure bound, not a synchronisation
FAST = {"capture_mode": "inline", "export_mode": "inline"}
COMPLETION = {"id": "c", "choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}


class Upstream:
    """A scripted upstream that counts the requests it saw whole."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        return web.json_response(COMPLETION)


def host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the proxy sends until it closes the connection (within GUARD)."""
    return await asyncio.wait_for(reader.read(), GUARD)


async def send_slowly(writer: asyncio.StreamWriter, data: bytes, every: float) -> None:
    """A slowloris: one byte at a time, until the proxy closes the connection."""
    for byte in data:
        if writer.is_closing():
            return
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(every)


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def test_a_head_sent_byte_by_byte_is_cut_with_408_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = Upstream()
    caplog.set_level(logging.WARNING, "trace_proxy.proxy.limits")
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, client_header_timeout=0.5, **FAST) as (service, proxy),
    ):
        for _ in range(2):  # the second is counted, not logged again
            reader, writer = await asyncio.open_connection(*host_port(proxy))
            slow = asyncio.ensure_future(send_slowly(writer, HEAD + b"X-Pad: " + b"a" * 200, 0.05))
            answer = await read_until_closed(reader)
            slow.cancel()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
            assert b"Connection: close" in answer
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="header_timeout") == 2  # fmt: skip
    assert upstream.bodies == []
    logged = [r for r in caplog.records if "--client-header-timeout" in r.getMessage()]
    assert len(logged) == 1


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(
    tmp_path: Path,
) -> None:
    async with running_proxy(["http://127.0.0.1:9"], tmp_path, client_header_timeout=0.3,
                             **FAST) as (service, proxy):  # fmt: skip
        reader, writer = await asyncio.open_connection(*host_port(proxy))
        assert await read_until_closed(reader) == b""
        writer.close()
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="header_timeout") == 1  # fmt: skip


async def test_an_idle_keep_alive_connection_is_not_a_slow_head(tmp_path: Path) -> None:
    """The head timer starts at a request's first byte: a rollout worker that keeps its
    connection open between calls (tool time, a weight update) is not cut."""
    upstream = Upstream()
    request = HEAD + b"Content-Length: 2\r\n\r\n{}"
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, client_header_timeout=0.3, **FAST) as (service, proxy),
    ):
        reader, writer = await asyncio.open_connection(*host_port(proxy))
        for _ in range(3):  # one connection, idle twice the head timeout between requests
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GUARD)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(0.6)  # idle on purpose
        writer.close()
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="header_timeout") == 0  # fmt: skip
    assert len(upstream.bodies) == 3


@pytest.mark.parametrize("length", [1000, 1 << 20], ids=["read-whole", "streamed"])
async def test_a_body_sent_slowly_is_cut_with_408_and_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, length: int
) -> None:
    """A small body is read whole before forwarding, a large one streamed: both are cut once
    the body timeout passes, the client gets a 408 and the connection closes, and the call is
    recorded with the reason."""
    upstream = Upstream()
    caplog.set_level(logging.WARNING, "trace_proxy.proxy.limits")
    head = HEAD + b"Content-Length: %d\r\nX-Rollout-Trajectory-Id: slow\r\n\r\n" % length
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, client_body_timeout=0.5, **FAST) as (service, proxy),
    ):
        reader, writer = await asyncio.open_connection(*host_port(proxy))
        writer.write(head + b'{"prompt": [1, 2')
        slow = asyncio.ensure_future(send_slowly(writer, b", 3" * 1000, 0.05))
        answer = await read_until_closed(reader)
        slow.cancel()
        writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout"
        error = orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "client_timeout"
        assert "did not arrive within 0.5 s" in error["message"]
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="body_timeout") == 1  # fmt: skip
    assert upstream.bodies == []  # never a whole request upstream
    [call] = all_calls(tmp_path)
    assert call["http_status"] == 408
    assert call["error"]["type"] == "transport"
    assert "client too slow" in call["error"]["message"]
    assert [r for r in caplog.records if "--client-body-timeout" in r.getMessage()]


async def test_slow_responses_are_never_timed(tmp_path: Path) -> None:
    """Only the request side has a clock: a stream that takes longer than both timeouts
    together reaches the client whole."""
    release = asyncio.Event()

    async def streaming(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await release.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with (
        scripted_upstream(streaming) as up,
        running_proxy(
            [up], tmp_path, client_header_timeout=0.2, client_body_timeout=0.2, **FAST
        ) as (_, proxy),
        aiohttp.ClientSession() as session,
        session.post(proxy + "/v1/completions", json={"prompt": "a", "stream": True}) as resp,
    ):
        assert await resp.content.readline() == b"data: 1\n"
        await asyncio.sleep(0.6)  # a generation taking its time, on purpose
        release.set()
        assert await asyncio.wait_for(resp.read(), GUARD) == b"\ndata: [DONE]\n\n"


async def test_a_head_over_the_limits_is_431_and_not_forwarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = Upstream()
    caplog.set_level(logging.WARNING, "trace_proxy.proxy.limits")
    too_many = {f"X-H{i}": "v" for i in range(40)}
    limits = {"max_header_size": 1024, "max_headers": 32}
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, **limits, **FAST) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        for headers in ({"X-Big": "a" * 2000}, too_many, {}):
            async with session.post(proxy + "/v1/completions", json={"prompt": "a"},
                                    headers=headers) as resp:  # fmt: skip
                body = await resp.read()
                if headers:
                    assert resp.status == 431
                    assert b"aaaa" not in body  # the offending bytes are not echoed
                else:
                    assert resp.status == 200
        async with session.post(proxy + "/v1/completions?" + "q" * 2000, json={}) as resp:
            assert resp.status == 431  # the request line counts too
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="header_too_large") == 3  # fmt: skip
    assert len(upstream.bodies) == 1
    logged = [r for r in caplog.records if "--max-header-size" in r.getMessage()]
    assert len(logged) == 1
    assert "aaaa" not in caplog.text


async def test_requests_that_are_not_http_are_400_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile or broken client must not fill the log: no traceback per bad request, one
    line for the kind, every one counted; nothing reaches the upstream."""
    upstream = Upstream()
    caplog.set_level(logging.DEBUG)
    bad = [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] * 3
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, **FAST) as (service, proxy),
    ):
        for request in bad:
            reader, writer = await asyncio.open_connection(*host_port(proxy))
            writer.write(request)
            answer = await read_until_closed(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 400 ") or answer.startswith(b"HTTP/1.0 400 ")
            assert b"abc" not in answer and b"Bad Header" not in answer
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="bad_request") == len(bad)  # fmt: skip
    assert upstream.bodies == []
    assert "Traceback" not in caplog.text
    assert len([r for r in caplog.records if "not valid HTTP/1.1" in r.getMessage()]) == 1


async def test_the_default_head_limits_are_aiohttps(tmp_path: Path) -> None:
    """8190 bytes a line and 128 lines, as before the options existed."""
    upstream = Upstream()
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, **FAST) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        for size, status in ((8000, 200), (8200, 431)):
            async with session.post(proxy + "/v1/completions", json={},
                                    headers={"X-Big": "b" * size}) as resp:  # fmt: skip
                assert resp.status == status


async def test_bodies_over_the_capture_limit_are_forwarded_and_recorded_unparsed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the capture process too: the call says why it has no bodies, and the counter
    says how often it happened (the log says it once)."""
    caplog.set_level(logging.WARNING, "trace_proxy.proxy.forward")
    big_response = {"id": "c", "choices": [{"index": 0, "text": "x" * 5000}]}

    async def upstream(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return web.json_response(COMPLETION if len(body) > 4000 else big_response)

    big_request = orjson.dumps({"prompt": list(range(2000))})
    small_request = orjson.dumps({"prompt": "a"})
    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path, capture_max_body=4096) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        for body, answer in ((big_request, COMPLETION), (small_request, big_response)):
            async with session.post(proxy + "/v1/completions", data=body,
                                    headers={"X-Rollout-Trajectory-Id": "t"}) as resp:  # fmt: skip
                assert await resp.json() == answer
        await service.flush()
        assert metric(service.metrics, "trace_proxy_capture_skipped_bodies_total",
                      reason="body_too_large") == 2  # fmt: skip
    request_over, response_over = all_calls(tmp_path)
    for call, which in ((request_over, "request"), (response_over, "response")):
        assert call["unparsed"].startswith(f"the {which} body is over the 4096-byte capture")
        assert call["http_status"] == 200
        assert call["outputs"] == []
    assert len([r for r in caplog.records if "--capture-max-body" in r.getMessage()]) == 1


async def test_a_control_route_over_the_limit_is_still_a_step_event(tmp_path: Path) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"success": True})

    tensors = orjson.dumps({"serialized_named_tensors": ["t" * 10_000], "weight_version": "v2"})
    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path, capture_max_body=4096, **FAST) as (_, proxy),
        aiohttp.ClientSession() as session,
        session.post(proxy + "/update_weights_from_tensor", data=tensors) as resp,
    ):
        assert resp.status == 200
    [event] = events(tmp_path)
    assert event["event"] == "weight_update"
    assert "capture limit" in event["params"]["unparsed"]


async def test_a_300_mb_streamed_body_is_forwarded_whole_and_never_held(tmp_path: Path) -> None:
    """A real upload of 300 MB, streamed: the upstream gets every byte, while memory
    allocated in this process (proxy, upstream and client alike) stays far below the body."""
    chunk = bytes(range(256)) * 4096  # 1 MiB, sent 300 times
    digest = hashlib.sha256()
    for _ in range(300):
        digest.update(chunk)
    received: dict[str, Any] = {}

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen, size = hashlib.sha256(), 0
        async for part in request.content.iter_any():
            seen.update(part)
            size += len(part)
        received.update(size=size, digest=seen.hexdigest())
        return web.json_response(COMPLETION)

    async def body() -> AsyncIterator[bytes]:
        for _ in range(300):
            yield chunk

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path, capture_max_body=8 << 20, **FAST) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        tracemalloc.start()
        try:
            async with session.post(proxy + "/v1/completions", data=body()) as resp:
                assert await resp.json() == COMPLETION
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await service.flush()
    assert received == {"size": 300 << 20, "digest": digest.hexdigest()}
    assert peak < 64 << 20, f"{peak >> 20} MiB allocated at the peak"
    [call] = all_calls(tmp_path)
    assert "capture limit" in call["unparsed"]


async def test_every_admin_route_that_changes_state_needs_the_token(tmp_path: Path) -> None:
    """Every route of the admin app, found from its router: reading ones are open, the others
    answer 401 without the token (a route added later is covered without a test of its own)."""
    async with running_proxy(["http://127.0.0.1:9"], tmp_path, admin_token="s3cret",
                             **FAST) as (service, _):  # fmt: skip
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        runner = service._admin_runner
        assert runner is not None and isinstance(runner.app, web.Application)
        routes = {(r.method, r.resource.canonical) for r in runner.app.router.routes()
                  if r.resource is not None}  # fmt: skip
        writes = {(m, p) for m, p in routes if m not in ("GET", "HEAD", "OPTIONS")}
        assert ("POST", "/rewards") in writes
        async with aiohttp.ClientSession() as session:
            for method, path in sorted(routes):
                for authorization in (None, "Bearer wrong", "Bearer s3crét", "s3cret"):
                    headers = {} if authorization is None else {"Authorization": authorization}
                    async with session.request(method, admin + path, json={},
                                               headers=headers) as resp:  # fmt: skip
                        if (method, path) in writes:
                            assert resp.status == 401, (method, path, authorization)
                        else:
                            assert resp.status == 200, (method, path)
            for method in ("POST", "PUT", "DELETE", "PATCH"):  # no such route: still 401 first
                async with session.request(method, admin + "/anything") as resp:
                    assert resp.status == 401
            reward = {"trajectory_id": "x", "reward": 1}
            token = {"Authorization": "Bearer s3cret"}
            async with session.post(admin + "/rewards", json=reward, headers=token) as resp:
                assert resp.status == 200


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False), ("127.0.0.1", None, False)],
)
async def test_an_admin_port_beyond_loopback_without_a_token_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, host: str, token: str | None, warned: bool
) -> None:
    caplog.set_level(logging.WARNING, "trace_proxy.proxy.service")
    async with running_proxy(["http://127.0.0.1:9"], tmp_path, host=host, admin_token=token,
                             **FAST):  # fmt: skip
        pass
    warnings = [r for r in caplog.records if "without --admin-token" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
