"""Start-up waits for nothing slow: the proxy listens and forwards while its export process is
still loading a tokenizer (here from a hub that answers only when the test says), /ready says
what is loading, and the calls made meanwhile are recorded. A tokenizer that turns out not to
load is still one clear error, exit code 2; the calls forwarded until then wait in the spool."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from fakes.hub import FakeHub
from support.proxies import trajectories
from support.serve import readiness, start_serve, until_ready

from processes.test_capture import chat
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer

GUARD = 60
LISTENS_WITHIN = 15.0  # seconds from exec to listening, on a loaded test machine


def hub_env(hub: str, home: Path) -> dict[str, str]:
    """The proxy's environment: tokenizers by name from `hub`, no cache yet, and patience
    (the hub answers when the test releases it)."""
    return {
        "HF_ENDPOINT": hub,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(home),
        "HF_HUB_ETAG_TIMEOUT": "600",
        "HF_HUB_DOWNLOAD_TIMEOUT": "600",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


async def complete(session: aiohttp.ClientSession, url: str, sample: int) -> bytes:
    """One closed trajectory of one completions call, with token ids to decode."""
    body = {"model": "tiny-qwen", "prompt": [9707, 11, 1879, sample], "max_tokens": 4,
            "return_token_ids": True}  # fmt: skip
    headers = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": str(sample),
               "X-Rollout-Done": "1"}  # fmt: skip
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200
        return await response.read()


async def export_queue(session: aiohttp.ClientSession, admin: str) -> float | None:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    found = re.search(r'^trace_proxy_export_queue\{backend="jsonl"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


async def test_forwarding_starts_while_the_export_process_loads_its_tokenizer(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    hub = FakeHub(ensure_qwen_tokenizer())
    loop = asyncio.get_running_loop()
    async with hub.serve() as hub_url, aiohttp.ClientSession() as session:
        began = loop.time()
        process, proxy, admin = await start_serve(
            upstream, tmp_path / "store", "--token2text", "--tokenizer", "acme/tiny-qwen",
            env=hub_env(hub_url, tmp_path / "hf"),
        )  # fmt: skip
        try:
            assert loop.time() - began < LISTENS_WITHIN
            # Forwarding works, byte for byte, while the tokenizer is still being fetched.
            bodies = [await complete(session, proxy, sample) for sample in range(3)]
            assert all(orjson.loads(body)["choices"] for body in bodies)
            assert bodies[0] == await complete(session, upstream, 0)
            await asyncio.wait_for(hub.asked.wait(), GUARD)
            async with session.get(admin + "/health") as response:
                assert response.status == 200
            # Not ready, naming what is loading; the calls wait in the spool meanwhile.
            deadline = loop.time() + GUARD
            while (await readiness(session, admin))[1]["checks"]["capture"] != "ok":
                assert loop.time() < deadline
                await asyncio.sleep(0.05)  # the capture process starts: polled, as /ready is
            status, body = await readiness(session, admin)
            assert status == 503, body
            assert {"export", "tokenizer"} <= set(body["not_ready"]), body
            assert body["checks"]["export"].startswith("starting (process ")
            assert body["checks"]["listening"] == body["checks"]["spool"] == "ok"
            while await export_queue(session, admin) != 3:
                assert loop.time() < deadline
                await asyncio.sleep(0.05)  # relayed once a second: polled
            assert not trajectories(tmp_path / "store")

            hub.release()
            await until_ready(session, admin, GUARD)
            _, body = await readiness(session, admin)
            assert body == {
                "status": "ready",
                "checks": dict.fromkeys(
                    ["listening", "capture", "export", "spool", "tokenizer"], "ok"
                ),
                "not_ready": [],
            }
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), GUARD)
    assert process.returncode == 0
    stored = trajectories(tmp_path / "store")
    assert sorted(t["key"]["sample_index"] for t in stored) == [0, 1, 2]  # each once
    assert all(t["calls"][0]["prompt_text"].startswith("Hello, world") for t in stored)


async def test_a_tokenizer_found_unloadable_after_listening_ends_the_proxy_with_one_error(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    hub = FakeHub(ensure_qwen_tokenizer(), serves=False)
    async with hub.serve() as hub_url, aiohttp.ClientSession() as session:
        process, proxy, admin = await start_serve(
            upstream, tmp_path, "--token2text", "--tokenizer", "acme/missing",
            env=hub_env(hub_url, tmp_path / "hf"),
        )  # fmt: skip
        try:
            assert orjson.loads(await chat(session, proxy, 1, 0))["choices"]
            await asyncio.wait_for(hub.asked.wait(), GUARD)
            hub.release()
            code = await asyncio.wait_for(process.wait(), GUARD)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.stderr is not None and process.stdout is not None
        stderr = (await process.stderr.read()).decode()
        stdout = (await process.stdout.read()).decode()
    assert code == 2
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("trace-proxy: error: invalid value for --tokenizer: ")
    assert "acme/missing" in errors[0]
    # The call forwarded meanwhile is kept: its trajectory and its step's summary.
    assert "left in the spool: jsonl 2" in stdout

    # Nothing was lost: the next start, here without token2text, exports it.
    process, _, admin = await start_serve(upstream, tmp_path)
    async with aiohttp.ClientSession() as session:
        await until_ready(session, admin, GUARD)
    process.terminate()
    assert await asyncio.wait_for(process.wait(), GUARD) == 0
    [trajectory] = trajectories(tmp_path)
    assert trajectory["key"]["step"] == 1 and len(trajectory["calls"]) == 1
