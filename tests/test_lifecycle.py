"""`trace-proxy serve` as a process: SIGTERM stops accepting, drains in-flight, flushes records."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from proxy_helpers import closed_port, scripted_upstream, trajectories

GUARD = 30


async def start_serve(
    upstream: str, output: Path, *extra: str
) -> tuple[asyncio.subprocess.Process, str, str]:
    """A `trace-proxy serve` process; its proxy and admin addresses from its ready line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trace_proxy", "serve", "--upstream", upstream,
        "--port", "0", "--admin-port", "0", "--output", str(output), *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), GUARD)).decode()
    match = re.search(r"forwarding (http://\S+) ->.* metrics at (http://\S+)/metrics", line)
    assert match, line
    return process, match.group(1), match.group(2)


async def test_sigterm_drains_in_flight_streams_then_flushes(tmp_path: Path) -> None:
    first_chunk_sent = asyncio.Event()
    finish_generation = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "text": "Hel", "token_ids": [1]}],
        }
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        first_chunk_sent.set()
        await finish_generation.wait()
        last = {"id": "c", "model": "m", "choices": [{"index": 0, "text": "lo", "token_ids": [2],
                                                      "finish_reason": "stop"}]}  # fmt: skip
        await response.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async with scripted_upstream(upstream) as up:
        process, proxy, _ = await start_serve(up, tmp_path)
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                proxy + "/v1/completions",
                json={"prompt": [5, 6, 7], "stream": True},
                headers={"X-Rollout-Step": "4", "X-Rollout-Sample-Index": "1"},
            )
            await asyncio.wait_for(first_chunk_sent.wait(), GUARD)
            process.send_signal(signal.SIGTERM)
            assert process.stdout is not None
            stopping = await asyncio.wait_for(process.stdout.readline(), GUARD)
            assert b"stopping" in stopping
            # New connections are refused while the in-flight stream is still served.
            try:
                await session.get(proxy + "/health", timeout=aiohttp.ClientTimeout(total=5))
                refused = False
            except aiohttp.ClientConnectionError:
                refused = True
            assert refused
            finish_generation.set()
            body = await asyncio.wait_for(response.read(), GUARD)
            assert body.endswith(b"data: [DONE]\n\n") and b'"lo"' in body
        assert await asyncio.wait_for(process.wait(), GUARD) == 0
    [trajectory] = trajectories(tmp_path)
    assert trajectory["close_reason"] == "shutdown"
    assert trajectory["key"]["step"] == 4
    [call] = trajectory["calls"]
    assert call["outputs"][0]["text"] == "Hello"
    assert call["outputs"][0]["token_ids"] == [1, 2]


async def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = blocker.sockets[0].getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trace_proxy", "serve",
        "--upstream", f"http://127.0.0.1:{closed_port()}", "--port", str(port),
        "--admin-port", "0", "--output", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), GUARD)
    blocker.close()
    assert process.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in stderr.decode()
