"""`trace-proxy serve` as a process: SIGTERM stops accepting, drains in-flight, flushes records."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from support.proxies import children, closed_port, scripted_upstream, trajectories
from support.serve import (
    GUARD,
    chat,
    readiness,
    start_serve,
    stored,
    until,
    until_gone,
    until_ready,
)

from trace_proxy.processes.lifeline import ORPHAN_SLACK


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
        process, proxy, admin = await start_serve(up, tmp_path)
        async with aiohttp.ClientSession() as session:
            await until_ready(session, admin)
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
            # Orchestrators stop routing here, and see why.
            status, ready = await readiness(session, admin)
            assert status == 503 and ready["not_ready"] == ["listening"]
            assert ready["checks"]["listening"] == "stopping"
            finish_generation.set()
            body = await asyncio.wait_for(response.read(), GUARD)
            assert body.endswith(b"data: [DONE]\n\n") and b'"lo"' in body
        assert await asyncio.wait_for(process.wait(), GUARD) == 0
        stopped = await process.stdout.read()
        assert stopped.endswith(b"trace-proxy: stopped; left in the spool: jsonl 0\n"), stopped
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


async def metric_sum(session: aiohttp.ClientSession, admin: str, prefix: str) -> float:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(prefix))  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_helpers_of_a_killed_proxy_finish_in_time_and_a_new_proxy_takes_over(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """SIGKILL leaves the helpers without their proxy. Here the export process also gets no
    CPU (stopped, as SCHED_IDLE on saturated cores would be). They finish what they hold and are
    gone within the grace and ORPHAN_SLACK; a new proxy on the same --output listens at once,
    waits for them before it writes or exports the spool, then exports what they left: every
    trajectory once."""
    _, upstream = fake_vllm
    grace = 3.0
    first, proxy, admin = await start_serve(upstream, tmp_path, "--shutdown-grace", str(grace))
    async with aiohttp.ClientSession() as session:
        await until_ready(session, admin)
        for sample in range(3):
            await chat(session, proxy, 1, sample)
        await until(lambda: len(trajectories(tmp_path)) == 3)
        [capture] = children(first.pid)
        [export] = children(capture)
        os.kill(export, signal.SIGSTOP)
        for sample in range(3, 6):  # spooled, not exported
            await chat(session, proxy, 1, sample)
        for _ in range(2):  # an open trajectory: only the capture process holds it
            await chat(session, proxy, 2, 0, done=False)

        async def all_recorded() -> bool:  # the capture process has them: what it holds
            return await metric_sum(session, admin, "trace_proxy_calls_recorded") == 8

        await until(all_recorded)
    first.kill()  # (its exit cannot be awaited: that waits for its pipes, which they hold)
    killed = asyncio.get_running_loop().time()
    await until_gone([first.pid], within=5.0)

    second, proxy, admin = await start_serve(upstream, tmp_path, "--shutdown-grace", str(grace))
    try:
        async with aiohttp.ClientSession() as session:
            await chat(session, proxy, 3, 0)  # forwarding does not wait for the leftovers

            async def waits_for_leftover() -> bool:
                _, body = await readiness(session, admin)
                return "waiting for process" in body["checks"]["export"]

            await until(waits_for_leftover)
            assert (await readiness(session, admin))[0] == 503
            await until_gone([capture, export], within=grace + ORPHAN_SLACK + 5)
            assert asyncio.get_running_loop().time() - killed < grace + ORPHAN_SLACK + 5
            await until_ready(session, admin)
    finally:
        second.terminate()
        assert await asyncio.wait_for(second.wait(), GUARD) == 0
        await first.wait()
    assert stored(tmp_path) == [(1, i, 1) for i in range(6)] + [(2, 0, 2), (3, 0, 1)]
    [held] = [t for t in trajectories(tmp_path) if t["key"]["step"] == 2]
    assert held["close_reason"] == "shutdown"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_sigterm_ends_a_helper_within_5_seconds_and_the_proxy_replaces_it(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    process, proxy, admin = await start_serve(upstream, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            await until_ready(session, admin)
            await chat(session, proxy, 1, 0, done=False)  # held by the capture process
            [capture] = children(process.pid)
            [export] = children(capture)
            os.kill(export, signal.SIGTERM)
            assert await until_gone([export], within=5.0) < 5.0
            os.kill(capture, signal.SIGTERM)
            assert await until_gone([capture], within=5.0) < 5.0
            await until_ready(session, admin)  # replaced
            await chat(session, proxy, 1, 1)
    finally:
        process.terminate()
        assert await asyncio.wait_for(process.wait(), GUARD) == 0
    # What the capture process held when it was told to go was spooled, then exported.
    assert stored(tmp_path) == [(1, 0, 1), (1, 1, 1)]


async def test_a_second_proxy_on_a_running_proxys_spool_is_a_clear_error(tmp_path: Path) -> None:
    upstream = f"http://127.0.0.1:{closed_port()}"
    first, _, admin = await start_serve(upstream, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            await until_ready(session, admin)
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trace_proxy", "serve", "--upstream", upstream,
            "--port", "0", "--admin-port", "0", "--output", str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(second.communicate(), GUARD)
    finally:
        first.terminate()
        await first.wait()
    assert second.returncode == 2 and not stdout  # it never listened
    [line] = stderr.decode().splitlines()
    assert line.startswith("trace-proxy: error: ")
    assert f"is the spool of another running trace-proxy (process {first.pid})" in line
