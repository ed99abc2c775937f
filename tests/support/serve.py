"""`trace-proxy serve` as a process inside a test: started as a user starts it, polled as an
orchestrator polls it, and its store read back."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from support.proxies import gone, trajectories

GUARD = 30


async def start_serve(
    upstream: str, output: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str, str]:
    """A `trace-proxy serve` process; its proxy and admin addresses from the line it prints
    once it listens."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trace_proxy", "serve", "--upstream", upstream,
        "--port", "0", "--admin-port", "0", "--output", str(output), *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )  # fmt: skip
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), GUARD)).decode()
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"the proxy did not listen within {GUARD} s") from None
    match = re.search(r"forwarding (http://\S+) ->.* metrics at (http://\S+)/metrics", line)
    assert match, line
    return process, match.group(1), match.group(2)


async def readiness(session: aiohttp.ClientSession, admin: str) -> tuple[int, dict[str, Any]]:
    async with session.get(admin + "/ready") as response:
        return response.status, await response.json()


async def until_ready(session: aiohttp.ClientSession, admin: str, within: float = GUARD) -> None:
    """Poll /ready until it says 200 (what an orchestrator does), or fail naming what is not."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        status, body = await readiness(session, admin)
        if status == 200:
            return
        assert loop.time() < deadline, body
        await asyncio.sleep(0.05)  # readiness is polled, as orchestrators do


async def until_gone(pids: list[int], within: float) -> float:
    """Seconds until every process is gone (an orphan's exit cannot be awaited: polled); fails
    past `within`."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not all(gone(pid) for pid in pids):
        alive = [pid for pid in pids if not gone(pid)]
        assert loop.time() - began < within, f"still running after {within} s: {alive}"
        await asyncio.sleep(0.05)
    return loop.time() - began


async def chat(session: aiohttp.ClientSession, proxy: str, step: int, sample: int,
               done: bool = True) -> None:  # fmt: skip
    body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": f"q{sample}"}],
            "max_tokens": 4}  # fmt: skip
    headers = {"X-Rollout-Step": str(step), "X-Rollout-Sample-Index": str(sample)}
    if done:
        headers["X-Rollout-Done"] = "1"
    async with session.post(proxy + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()


async def until(check: Callable[[], Any], within: float = GUARD) -> None:
    """Poll a condition (relayed metrics, files another process writes; a coroutine or not)
    with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, "not within the deadline"
        await asyncio.sleep(0.05)


def stored(output: Path) -> list[tuple[int, int, int]]:
    """(step, sample, calls) of every stored trajectory, sorted: duplicates show."""
    return sorted((t["key"]["step"], t["key"]["sample_index"], len(t["calls"]))
                  for t in trajectories(output))  # fmt: skip
