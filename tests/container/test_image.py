"""The image built from docker/Dockerfile, run as a user runs it: healthy, forwarding, recording
to its volume, stopping cleanly on SIGTERM, as a non-root user on a read-only root filesystem.

The container shares the host's network (as a sidecar shares its pod's), in front of the
simulated vLLM server (tests/fakes); the rollouts are the demo's multi-turn, tool-calling
agent, through the real OpenAI client.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeVLLM, StartFake
from openai import AsyncOpenAI, AsyncStream
from openai.types.chat import ChatCompletionChunk
from support.proxies import closed_port, trajectories

from trace_proxy.demo.run import rollout

from .daemon import DockerDaemon
from .image import image_size
from .provision import BASE_IMAGE

UID = 10001  # docker/Dockerfile's USER
HEALTHY_TIMEOUT_S = 180.0
SHUTDOWN_GRACE_S = 10
STOP_TIMEOUT_S = 2 * SHUTDOWN_GRACE_S + 5  # drain, then flush: each within the grace
SAMPLES, ROLLOUTS = 3, 2
SLOW_TOKENS, SLOW_TOKEN_S = 100, 0.5  # in flight until SIGTERM is seen, then sped up


def inspect(daemon: DockerDaemon, container: str) -> dict[str, Any]:
    result: list[dict[str, Any]] = json.loads(daemon.run("inspect", container).stdout)
    return result[0]


async def wait_healthy(daemon: DockerDaemon, container: str) -> None:
    """Poll Docker's view of the image's HEALTHCHECK until healthy; fail if it exits first."""
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    while True:
        state = (await asyncio.to_thread(inspect, daemon, container))["State"]
        if state["Health"]["Status"] == "healthy":
            return
        if not state["Running"] or time.monotonic() > deadline:
            logs = daemon.run("logs", container, check=False)
            pytest.fail(f"container not healthy ({state}):\n{logs.stdout}{logs.stderr}")
        await asyncio.sleep(0.5)  # polling the daemon's health status


async def _all(stream: AsyncStream[ChatCompletionChunk]) -> list[ChatCompletionChunk]:
    return [chunk async for chunk in stream]


async def wait_stopping(admin_port: int) -> None:
    """Poll /ready until it says the listener is stopping (the proxy has taken SIGTERM)."""
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"http://127.0.0.1:{admin_port}/ready") as response:
                body = await response.json()
            if body["checks"]["listening"] == "stopping":
                return
            await asyncio.sleep(0.1)  # polling the proxy's own readiness
    pytest.fail("the proxy never said it was stopping after docker stop")


def test_image_without_extras_stays_close_to_the_base_image(
    docker_daemon: DockerDaemon, image: str
) -> None:
    assert image_size(docker_daemon, image) <= 1.3 * image_size(docker_daemon, BASE_IMAGE)


def test_image_runs_the_proxy_itself_as_a_fixed_non_root_user(
    docker_daemon: DockerDaemon, image: str
) -> None:
    config = inspect(docker_daemon, image)["Config"]
    assert config["User"] == f"{UID}:{UID}"  # numeric: Kubernetes' runAsNonRoot can check it
    assert config["Entrypoint"] == ["trace-proxy", "serve"]  # exec form: no shell in between
    assert config["Healthcheck"]["Test"][0] == "CMD"  # exec form too
    assert set(config["ExposedPorts"]) == {"8100/tcp", "8101/tcp"}
    assert set(config["Volumes"]) == {"/data"}


async def test_container_forwards_records_and_drains_on_sigterm(
    docker_daemon: DockerDaemon,
    image: str,
    free_volume: str,
    qwen_tokenizer: Any,
    start_fake: StartFake,
) -> None:
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    upstream = await start_fake(fake)
    port, admin_port = closed_port(), closed_port()
    while admin_port == port:
        admin_port = closed_port()
    name = f"trace-proxy-smoke-{port}"
    run = [
        "run", "--detach", "--name", name, "--network", "host", "--read-only",
        "--volume", f"{free_volume}:/data",
        "--health-interval", "1s",  # the image's check, run sooner than its 10 s interval
        "--env", f"TRACE_PROXY_UPSTREAM={upstream}",
        "--env", "TRACE_PROXY_HOST=127.0.0.1",  # the host's network: stay on its loopback
        "--env", f"TRACE_PROXY_PORT={port}", "--env", f"TRACE_PROXY_ADMIN_PORT={admin_port}",
        "--env", f"TRACE_PROXY_SHUTDOWN_GRACE={SHUTDOWN_GRACE_S}",
        "--env", "TRACE_PROXY_STEP_CLOSE_GRACE=0",
        image,
    ]  # fmt: skip
    await asyncio.to_thread(docker_daemon.run, *run)
    try:
        await wait_healthy(docker_daemon, name)
        state = (await asyncio.to_thread(inspect, docker_daemon, name))["State"]
        status = Path(f"/proc/{state['Pid']}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        assert fields["Uid"].split() == [str(UID)] * 4  # real, effective, saved, filesystem
        assert fields["NSpid"].split()[-1] == "1"  # the proxy is the container's PID 1
        cmdline = Path(f"/proc/{state['Pid']}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline and not any(arg.endswith(b"sh") for arg in cmdline)

        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="never-recorded")
        try:
            results = await asyncio.gather(
                *(
                    rollout(client, "tiny-qwen", 1, sample, n, stream=(sample + n) % 2 == 1)
                    for sample in range(SAMPLES)
                    for n in range(ROLLOUTS)
                )
            )
            # A generation still streaming when `docker stop` sends SIGTERM to PID 1: it
            # finishes, and is recorded, before the proxy exits. Past the timeout Docker
            # would SIGKILL it (exit code 137).
            fake.token_delay = SLOW_TOKEN_S
            stream = await client.chat.completions.create(
                model="tiny-qwen", messages=[{"role": "user", "content": "Count slowly."}],
                max_tokens=SLOW_TOKENS, extra_body={"ignore_eos": True}, stream=True,
                extra_headers={"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "99"},
            )  # fmt: skip
            chunks = [await stream.__anext__()]  # the generation has started
            rest = asyncio.create_task(_all(stream))
            stopping = asyncio.create_task(
                asyncio.to_thread(docker_daemon.run, "stop", "--time", str(STOP_TIMEOUT_S), name)
            )
            await wait_stopping(admin_port)  # SIGTERM taken: /ready answers 503
            assert not rest.done(), "the generation ended before SIGTERM reached the proxy"
            fake.token_delay = 0.0  # now let it finish
            chunks += await rest
        finally:
            await client.close()
        await stopping
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"  # the whole generation, not a cut connection

        state = (await asyncio.to_thread(inspect, docker_daemon, name))["State"]
        logs = docker_daemon.run("logs", name).stdout
        assert state["ExitCode"] == 0, logs
        assert not state["OOMKilled"]
        assert "trace-proxy: stopped; left in the spool: jsonl 0" in logs

        store = docker_daemon.volume_path(free_volume) / "traces"
        recorded = trajectories(store)
        slow = [t for t in recorded if t["key"]["sample_index"] == 99]
        assert [len(t["calls"]) for t in slow] == [1]
        assert slow[0]["calls"][0]["outputs"][0]["finish_reason"] == "length"
        rollouts = [t for t in recorded if t["key"]["sample_index"] != 99]
        assert sorted(len(t["calls"]) for t in rollouts) == sorted(turns for turns, _ in results)
        keys = {(t["key"]["sample_index"], t["key"]["rollout_n"]) for t in rollouts}
        assert keys == {(s, n) for s in range(SAMPLES) for n in range(ROLLOUTS)}
        assert not any(b"never-recorded" in p.read_bytes() for p in store.rglob("*") if p.is_file())
        owners = {p.stat().st_uid for p in store.rglob("*.jsonl")}
        assert owners == {UID}
    finally:
        docker_daemon.run("rm", "--force", name, check=False)
