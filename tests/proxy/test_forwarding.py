"""Transport behaviour of the hot path, with scripted upstreams for the faults.

Synchronisation is by events between the test and the upstream, never by sleeping: e.g. the
upstream sends its second chunk only after the client has received the first.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from support.proxies import all_calls, closed_port, running_proxy, scripted_upstream, trajectories

GUARD = 20  # seconds: a failure bound, not a synchronisation


async def test_a_late_upstream_chunk_is_not_held_back(tmp_path: Path) -> None:
    release_second = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await release_second.wait()
        await response.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
        return response

    async with scripted_upstream(upstream) as up, running_proxy([up], tmp_path) as (_, proxy):
        async with aiohttp.ClientSession() as session:
            async with session.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), GUARD)
                assert first == b'data: {"n": 1}\n\n'
                release_second.set()
                rest = await asyncio.wait_for(resp.content.read(), GUARD)
                assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("before_first_byte", [True, False])
async def test_client_disconnect_closes_the_upstream_request(
    tmp_path: Path, before_first_byte: bool
) -> None:
    upstream_saw_disconnect = asyncio.Event()
    upstream_started = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            if not before_first_byte:
                await response.prepare(request)
                await response.write(b'data: {"n": 1}\n\n')
            upstream_started.set()
            await asyncio.Event().wait()  # a generation that would run for minutes
        except asyncio.CancelledError:
            upstream_saw_disconnect.set()
            raise
        return response

    async with scripted_upstream(upstream) as up, running_proxy([up], tmp_path) as (_, proxy):
        session = aiohttp.ClientSession()
        request = asyncio.ensure_future(
            session.post(proxy + "/v1/completions", json={"prompt": [1, 2], "stream": True})
        )
        await asyncio.wait_for(upstream_started.wait(), GUARD)
        if not before_first_byte:
            resp = await asyncio.wait_for(request, GUARD)
            await resp.content.readuntil(b"\n\n")
            resp.close()
        else:
            request.cancel()
        await session.close()
        await asyncio.wait_for(upstream_saw_disconnect.wait(), GUARD)
    [call] = all_calls(tmp_path)
    assert call["error"] == {"type": "transport", "message": "client disconnected"}


async def test_unreachable_upstream_is_502_naming_it(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    async with running_proxy([dead], tmp_path) as (_, proxy), aiohttp.ClientSession() as session:
        async with session.post(proxy + "/v1/chat/completions", json={"messages": []}) as resp:
            assert resp.status == 502
            body = await resp.json()
    assert body["error"]["type"] == "upstream_unreachable"
    assert body["error"]["upstream"] == dead
    assert dead in body["error"]["message"] and "refused" in body["error"]["message"].lower()
    [call] = all_calls(tmp_path)
    assert call["http_status"] == 502 and call["error"]["type"] == "transport"


async def test_silent_upstream_is_504_after_the_read_timeout(tmp_path: Path) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path, read_timeout=0.3) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        async with session.post(proxy + "/generate", json={"text": "hi"}) as resp:
            assert resp.status == 504
            body = await resp.json()
    assert body["error"]["type"] == "upstream_timeout"
    assert body["error"]["upstream"] == up


async def test_upstream_dying_mid_stream_cuts_the_client_connection(tmp_path: Path) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        assert request.transport is not None
        request.transport.abort()  # the server process died
        return response

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        async with session.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.read(), GUARD)
    [call] = all_calls(tmp_path)
    assert "mid-response" in call["error"]["message"]


async def test_headers_hop_by_hop_dropped_forwarded_added(tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        return web.Response(
            body=b"ok",
            headers={"X-Upstream": "1", "Keep-Alive": "timeout=5", "Connection": "keep-alive"},
        )

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        headers = {
            "Authorization": "Bearer sk-forward-me",
            "X-Custom": "kept",
            "TE": "trailers",
            "Proxy-Authorization": "Basic Zm9vOmJhcg==",
            "Connection": "X-Drop-Me",
            "X-Drop-Me": "listed in Connection",
            "X-Forwarded-For": "10.1.2.3",
        }
        async with session.get(proxy + "/v1/models", headers=headers) as resp:
            assert resp.headers["X-Upstream"] == "1"
            assert "Keep-Alive" not in resp.headers
    [got] = seen
    assert got["Authorization"] == "Bearer sk-forward-me"
    assert got["X-Custom"] == "kept"
    for dropped in ("TE", "Proxy-Authorization", "X-Drop-Me"):
        assert dropped not in got
    assert got["X-Forwarded-For"] == "10.1.2.3, 127.0.0.1"
    assert got["X-Forwarded-Proto"] == "http"
    assert got["Host"] == up.removeprefix("http://")


async def test_bodies_pass_byte_for_byte_including_compressed_and_large(tmp_path: Path) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return web.Response(
            body=gzip.compress(body, mtime=0),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    big = orjson.dumps({"prompt": list(range(600_000)), "max_tokens": 1})  # ~4.5 MB of ids
    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession(auto_decompress=False) as session,
    ):
        direct = await session.post(up + "/v1/completions", data=big)
        via_proxy = await session.post(proxy + "/v1/completions", data=big)
        direct_body, proxy_body = await direct.read(), await via_proxy.read()
        assert proxy_body == direct_body == gzip.compress(big, mtime=0)
        assert via_proxy.headers["Content-Encoding"] == "gzip"
        assert via_proxy.headers["Content-Length"] == direct.headers["Content-Length"]


async def test_no_request_can_choose_another_upstream(tmp_path: Path) -> None:
    hits: dict[str, list[str]] = {"upstream": [], "elsewhere": []}

    def recorder(name: str):  # type: ignore[no-untyped-def]
        async def handler(request: web.Request) -> web.StreamResponse:
            hits[name].append(request.raw_path)
            return web.Response(text=name)

        return handler

    async with (
        scripted_upstream(recorder("upstream")) as up,
        scripted_upstream(recorder("elsewhere")) as elsewhere,
        running_proxy([up], tmp_path) as (_, proxy),
    ):
        other = elsewhere.removeprefix("http://")
        host, port = proxy.removeprefix("http://").split(":")
        async with aiohttp.ClientSession() as session:
            for path in ("//" + other + "/x", "/@" + other + "/x", "/%2F%2F" + other):
                async with session.get(proxy + path, headers={"Host": other}) as resp:
                    assert await resp.text() == "upstream"
        # An absolute-form request target, written by hand.
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET {elsewhere}/abs HTTP/1.1\r\nHost: {other}\r\n\r\n".encode())
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(4096), GUARD)
        writer.close()
        assert reply.endswith(b"upstream")
    assert hits["elsewhere"] == []
    assert "/abs" in hits["upstream"]


async def test_secrets_are_neither_recorded_nor_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "bad", "type": "x"}}, status=400)

    secrets = {
        "Authorization": "Bearer sk-SECRET-1",
        "Cookie": "session=SECRET-2",
        "X-API-Key": "SECRET-3",
        "Api-Key": "SECRET-4",
    }
    caplog.set_level(logging.DEBUG)
    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        await session.post(
            proxy + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={**secrets, "X-Rollout-Trajectory-Id": "t1"},
        )
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*.jsonl"))
    assert stored, "the call must be recorded"
    for value in secrets.values():
        assert value.encode() not in stored
        assert value not in caplog.text
    [call] = all_calls(tmp_path)
    assert call["request_headers"]["authorization"] == "[redacted]"
    assert call["error"]["type"] == "http_400"


async def test_calls_of_a_trajectory_stick_to_one_upstream(tmp_path: Path) -> None:
    served: dict[str, list[str]] = {"a": [], "b": []}

    def counting(name: str):  # type: ignore[no-untyped-def]
        async def handler(request: web.Request) -> web.StreamResponse:
            served[name].append(request.headers["X-Rollout-Trajectory-Id"])
            return web.Response(text=name)

        return handler

    async with (
        scripted_upstream(counting("a")) as a,
        scripted_upstream(counting("b")) as b,
        running_proxy([a, b], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        for _turn in range(3):
            await asyncio.gather(
                *(
                    session.get(proxy + "/health", headers={"X-Rollout-Trajectory-Id": f"t{i}"})
                    for i in range(20)
                )
            )
    assert served["a"] and served["b"], "new trajectories are spread over both upstreams"
    assert not set(served["a"]) & set(served["b"])
    assert len(served["a"]) + len(served["b"]) == 60


async def test_unparsable_body_is_forwarded_untouched_and_recorded_as_unparsed(
    tmp_path: Path,
) -> None:
    received: list[bytes] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        received.append(await request.read())
        return web.json_response({"error": "bad json"}, status=400)

    body = b'{"messages": [ this is not json'
    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
        session.post(
            proxy + "/v1/chat/completions", data=body, headers={"X-Rollout-Step": "1"}
        ) as resp,
    ):
        assert resp.status == 400
    assert received == [body]
    [t] = trajectories(tmp_path)
    [call] = t["calls"]
    assert call["unparsed"].startswith("request is not JSON")
    assert call["error"] == {"type": "http_400", "message": "bad json"}


async def test_a_large_chunked_upload_is_streamed_and_still_recorded(tmp_path: Path) -> None:
    prompt = list(range(100_000))
    payload = orjson.dumps({"prompt": prompt, "max_tokens": 1})
    seen: list[tuple[str | None, bytes]] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("Transfer-Encoding"), await request.read()))
        return web.json_response({"id": "c", "choices": [{"index": 0, "text": "!"}]})

    async def chunks():  # type: ignore[no-untyped-def]
        for start in range(0, len(payload), 65536):
            yield payload[start : start + 65536]

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        async with session.post(
            proxy + "/v1/completions", data=chunks(), headers={"X-Rollout-Trajectory-Id": "big"}
        ) as resp:
            assert resp.status == 200
    assert seen == [("chunked", payload)]
    [call] = all_calls(tmp_path)
    assert call["prompt"]["token_ids"] == prompt
    assert call["outputs"][0]["text"] == "!"
