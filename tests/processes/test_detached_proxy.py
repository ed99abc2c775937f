"""A proxy started by verl's plugin outlives the Ray actor that started it just long enough to
write what it holds.

When a job ends, Ray SIGKILLs each actor's direct children and the actor's whole process
group; the actor itself dies without running its exit handlers. Here a process that starts a
proxy with the plugin's launcher is killed exactly so (its children by pid, then its group,
all with SIGKILL): the proxy, started detached, notices its starter's death, closes what is
open, writes every record and exits within its bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeVLLM
from support.proxies import children, gone, trajectories
from support.serve import chat, stored, until, until_gone

from trace_proxy.processes.lifeline import ORPHAN_SLACK, orphan_bound

GRACE = 3.0
GUARD = 60

STARTER = """
import json, sys
from trace_proxy.integrations.verl.launcher import launch
proxy = launch(["--upstream", sys.argv[1], "--output", sys.argv[2],
                "--shutdown-grace", sys.argv[3]], 60.0)
print(json.dumps({"pid": proxy.process.pid, "proxy": proxy.proxy_url,
                  "admin": proxy.admin_url}), flush=True)
sys.stdin.read()  # lives until killed, as an actor does
"""


async def start_starter(upstream: str, output: Path) -> tuple[subprocess.Popen[str], Any]:
    """A process that starts a proxy as the plugin's actor does, in a process group of its
    own, as Ray starts each worker."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, upstream, str(output), str(GRACE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert starter.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(starter.stdout.readline), GUARD)
    assert line, "the starter printed nothing"
    return starter, json.loads(line)


def kill_as_ray_does(starter: subprocess.Popen[str]) -> None:
    """Ray's end of a worker: its direct children, then its process group, SIGKILLed."""
    for child in children(starter.pid):
        os.kill(child, signal.SIGKILL)
    os.killpg(starter.pid, signal.SIGKILL)
    starter.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_a_proxy_whose_starter_is_killed_writes_what_it_holds_and_exits(
    qwen_tokenizer: Any, tmp_path: Path
) -> None:
    """Closed, open and still generating when the run ends (the last step of an asynchronous
    run: its client dies with the job): every trajectory is written."""
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True, token_delay=0.05)
    async with fake.serve() as upstream:
        starter, started = await start_starter(upstream, tmp_path)
        generating = None
        try:
            assert started["pid"] not in children(starter.pid)  # nobody's child in its tree
            async with aiohttp.ClientSession() as session:
                await chat(session, started["proxy"], 1, 0)  # closed by done
                await until(lambda: stored(tmp_path) == [(1, 0, 1)])
                for sample in (1, 2):  # open: only the proxy's capture process holds them
                    await chat(session, started["proxy"], 1, sample, done=False)
            client = aiohttp.ClientSession()
            generating = await client.post(
                started["proxy"] + "/v1/chat/completions",
                json={"model": "tiny-qwen", "messages": [{"role": "user", "content": "q3"}],
                      "max_tokens": 400, "stream": True},
                headers={"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "3"},
            )  # fmt: skip
            assert generating.status == 200
            await generating.content.readline()  # the upstream is generating
        finally:
            kill_as_ray_does(starter)
            if generating is not None:  # its client dies with the job
                generating.close()
                await client.close()
        await until_gone([started["pid"]], within=orphan_bound(GRACE) + GRACE + ORPHAN_SLACK)
    assert stored(tmp_path) == [(1, 0, 1), (1, 1, 1), (1, 2, 1), (1, 3, 1)]
    assert sorted(t["close_reason"] for t in trajectories(tmp_path)) == [
        "done", "shutdown", "shutdown", "shutdown"]  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_a_stopped_proxy_drains_and_its_starter_sees_it_end(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """The launcher's own stop (SIGTERM through the proxy's pidfd) drains it, and the starter
    learns that the proxy, which is not its child, has exited."""
    from trace_proxy.integrations.verl.launcher import launch

    _, upstream = fake_vllm
    proxy = await asyncio.to_thread(
        launch, ["--upstream", upstream, "--output", str(tmp_path),
                 "--shutdown-grace", str(GRACE)], 60.0)  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            await chat(session, proxy.proxy_url, 1, 0, done=False)
    finally:
        await asyncio.to_thread(proxy.stop)
    assert not proxy.process.running() and gone(proxy.process.pid)
    [record] = trajectories(tmp_path)
    assert record["close_reason"] == "shutdown"
