"""The RL frameworks' own client code through trace-proxy, as their users would run it.

Each client (tests/real/frameworks/drive.py, run in the provisioned frameworks venv) plays the
same small workload twice, once pointed at the server and once at the proxy: three samples, the
first with two rollouts, two turns each. vLLM-dialect clients talk to the real vLLM CPU build,
SGLang-dialect ones to the SGLang fake (SGLang has no CPU build). What the framework handed back
must be the same both ways, and the store must hold what the traffic implies: one trajectory
per rollout, its calls and prompts those of that rollout and no other, GRPO groups, steps, and
the metadata the framework sends (SkyRL's `X-Session-ID` and `/finish_session`, the session of
rllm's gateway). The two rollouts of the first sample are greedy and so identical: no traffic
can tell their second turns apart, and each must start a trajectory of its own marked
`inferred:ambiguous` rather than be attached to either (unless the client names its sessions).
skyrl-train is also run from the proxy's first seconds, before its tokenizer has loaded, on a
GRPO group of sampled rollouts that only decoding tells apart.

slime and rllm's own engines are not on PyPI; their wire formats are those of the SGLang
`/generate` and OpenAI clients exercised here (see docs/integrations/).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.proxies import HeldLoader, release_as_stop_begins, running_proxy, trajectories

from trace_proxy.config import Settings
from trace_proxy.processes import text_path
from trace_proxy.proxy.service import ProxyService
from trace_proxy.trajectories.prompts import expand_prompts

if TYPE_CHECKING:
    from .conftest import RealServer

DRIVER = Path(__file__).resolve().parent / "frameworks" / "drive.py"
CLIENTS = {  # client -> the dialect of its server, and the route its generates take
    "areal-vllm": ("vllm", "/v1/completions"),
    "areal-sglang": ("sglang", "/generate"),
    "skyrl": ("vllm", "/inference/v1/generate"),
    "skyrl-train-vllm": ("vllm", "/v1/completions"),
    "skyrl-train-sglang": ("sglang", "/generate"),
    "openai": ("vllm", "/v1/chat/completions"),
    "rllm-gateway": ("vllm", "/v1/chat/completions"),
}
SESSION_MAP = "map:header:X-Session-ID=trajectory_id"  # the default --map rule
NAMES_SESSIONS = {"skyrl", "rllm-gateway"}  # send X-Session-ID per rollout
Json = dict[str, Any]


async def _drive(
    python: Path, client: str, urls: list[str], model_dir: Path, out: Path, *options: str
) -> list[Json]:
    """The workload once per URL, in that order, in one process of the frameworks venv
    (`options`: drive.py's, e.g. `--group 4`)."""
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(DRIVER),
        *options,
        client,
        str(model_dir),
        str(out),
        *urls,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 900)
    assert process.returncode == 0, output.decode(errors="replace")[-4000:]
    results: list[Json] = json.loads(out.read_text())
    return results


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.asynccontextmanager
async def _gateway(python: Path, worker: str, log: Path) -> AsyncIterator[str]:
    """rllm's model gateway (its own PyPI release) with `worker` as its one worker."""
    port = _free_port()
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            str(python),
            "-m",
            "rllm_model_gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker",
            worker,
            "--store",
            "memory",
            stdout=out,
            stderr=out,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(_healthy, url):
                assert process.returncode is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the gateway did not come up"
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(process.wait(), 0.5)
            yield url
        finally:
            if process.returncode is None:
                process.terminate()
                await process.wait()


async def _run(
    python: Path, client: str, targets: list[str], model_dir: Path, work: Path
) -> list[Json]:
    """The workload with the framework pointed at each target (rllm: its gateway's worker)."""
    if client != "rllm-gateway":
        return await _drive(python, client, targets, model_dir, work / "out.json")
    async with contextlib.AsyncExitStack() as stack:
        gateways = [
            await stack.enter_async_context(_gateway(python, target, work / f"gateway{k}.log"))
            for k, target in enumerate(targets)
        ]
        return await _drive(python, client, gateways, model_dir, work / "out.json")


@pytest.mark.parametrize("client", list(CLIENTS))
async def test_a_framework_client_through_the_proxy(
    client: str,
    real_vllm: RealServer,
    fake_sglang: tuple[Any, str],
    frameworks_python: Path,
    tmp_path: Path,
) -> None:
    dialect, route = CLIENTS[client]
    upstream = real_vllm.base_url if dialect == "vllm" else fake_sglang[1]
    model_dir = real_vllm.model_dir  # the real Qwen tokenizer, which both servers use
    store = tmp_path / "store"
    async with running_proxy(
        [upstream], store, tokenizer=[str(model_dir)], idle_timeout=3600.0
    ) as (_, proxy):
        direct, proxied = await _run(
            frameworks_python, client, [upstream, proxy], model_dir, tmp_path
        )
    # The one address change is all the framework sees: what it got back is the same.
    assert proxied["rollouts"] == direct["rollouts"]
    _check_store(client, route, proxied["rollouts"], trajectories(store))


async def test_skyrl_train_from_the_proxy_s_first_seconds(
    real_vllm: RealServer,
    frameworks_python: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """skyrl-train's RemoteInferenceEngine (batched /v1/completions, replies kept as text,
    re-encoded into the next prompt) pointed at a proxy that has just started with
    `--tokenizer`, then the proxy stopped, as a short training script ends: a GRPO group of four
    sampled rollouts, whose second turns only decoding tells apart. The tokenizer is still
    loading all along (held until the stop begins; capture in the proxy's process, where the
    test can hold it): each rollout is one two-turn trajectory all the same, none ambiguous."""
    loader = HeldLoader()
    monkeypatch.setattr(text_path, "load_configured", loader)
    model_dir = real_vllm.model_dir
    store = tmp_path / "store"
    settings = dataclasses.replace(
        Settings(), upstream=[real_vllm.base_url], port=0, admin_port=0, output=store,
        capture_mode="inline", export_mode="inline", tokenizer=[str(model_dir)],
        idle_timeout=3600.0,
    )  # fmt: skip
    service = ProxyService(settings)
    addresses = await service.start()  # traffic from now on: no wait for /ready
    release_as_stop_begins(service, loader)
    try:
        [run] = await _drive(
            frameworks_python, "skyrl-train-vllm", [addresses.proxy], model_dir,
            tmp_path / "out.json", "--group", "4",
        )  # fmt: skip
    finally:
        await service.stop()
        loader.released.set()
    rollouts = run["rollouts"]
    records = trajectories(store)
    replies = [r["turns"][0]["text"] for r in rollouts]
    assert len(set(replies)) == len(replies), "sampled replies that happen to be equal"
    ambiguous = [r for r in records if r["key"]["sources"]["trajectory_id"] == "inferred:ambiguous"]
    assert not ambiguous
    assert len(records) == len(rollouts) == 4
    owners = []  # each trajectory: every turn of one rollout, its prompt ids and reply
    for record in records:
        prompts = expand_prompts(record)
        [owner] = [
            r["session"]
            for r in rollouts
            if len(record["calls"]) == len(r["turns"])
            and all(map(_same_turn, record["calls"], prompts, r["turns"]))
        ]
        owners.append(owner)
    assert sorted(owners) == sorted(r["session"] for r in rollouts)
    assert sorted(r["key"]["rollout_n"] for r in records) == [0, 1, 2, 3]
    assert len({r["key"]["sample_hash"] for r in records}) == 1


def _same_turn(call: Json, prompt: Json, turn: Json) -> bool:
    """A recorded call is this turn: same prompt ids (when the client sent ids) and the same
    output, by ids or by text, whichever the client got."""
    output = (call.get("outputs") or [{}])[0]
    sent = turn["prompt_ids"]  # None for chat: the messages were sent
    if sent is not None and prompt.get("token_ids") != sent:
        return False
    if turn.get("output_ids") is not None and output.get("token_ids") == turn["output_ids"]:
        return True
    return turn.get("text") is not None and output.get("text") == turn["text"]


def _check_store(client: str, route: str, rollouts: list[Json], records: list[Json]) -> None:
    calls = [call for record in records for call in record["calls"]]
    assert len(calls) == sum(len(r["turns"]) for r in rollouts), "a call per turn, no more"
    assert {call["route"] for call in calls} == {route}
    # Nothing attached to the wrong rollout: every trajectory's calls are turns k, k+1, ... of
    # one rollout (turn 0 onward, unless it was started for an ambiguous continuation).
    for record in records:
        prompts = expand_prompts(record)
        owners = [
            r
            for r in rollouts
            for start in range(len(r["turns"]) - len(record["calls"]) + 1)
            if all(
                _same_turn(c, p, t)
                for c, p, t in zip(record["calls"], prompts, r["turns"][start:], strict=False)
            )
            and (start == 0 or record["key"]["sources"]["trajectory_id"] == "inferred:ambiguous")
        ]
        assert owners, f"{client}: a trajectory no rollout explains: {record['key']}"
    by_sample: dict[int, list[Json]] = {}
    for rollout in rollouts:
        first = rollout["turns"][0]
        holders = [
            rec for rec in records if _same_turn(rec["calls"][0], expand_prompts(rec)[0], first)
        ]
        by_sample.setdefault(rollout["sample"], []).extend(holders)
    # Rollouts with a prompt of their own: one trajectory each, with every turn.
    for sample in (1, 2):
        [record] = by_sample[sample]
        assert len(record["calls"]) == len(rollouts[-1]["turns"])
    # The group of two identical rollouts: two trajectories, rollout_n 0 and 1, one sample.
    group = {id(r): r for r in by_sample[0]}.values()
    assert sorted(r["key"]["rollout_n"] for r in group) == [0, 1]
    hashes = {r["key"]["sample_hash"] for r in records if r["key"].get("sample_hash")}
    assert len({r["key"]["sample_hash"] for r in group}) == 1 and len(hashes) == 3
    assert {r["key"]["step"] for r in records} == {0}
    assert {r["key"]["sources"]["step"] for r in records} == {"inferred:weight_updates"}
    if client in NAMES_SESSIONS:
        ids = sorted(r["key"]["trajectory_id"] for r in records)
        assert ids == sorted(r["session"] for r in rollouts)  # one per rollout, as named
        assert {r["key"]["sources"]["trajectory_id"] for r in records} == {SESSION_MAP}
        assert all(len(r["calls"]) == len(rollouts[0]["turns"]) for r in records)
        if client == "skyrl":  # /finish_session closed each at once, not the shutdown
            assert {r["close_reason"] for r in records} == {"done"}
    else:
        # Keyless: the identical second turns of sample 0 are each on their own, marked.
        second = [
            rec
            for rec in records
            if len(rec["calls"]) == 1
            and rec["key"]["sources"]["trajectory_id"] == "inferred:ambiguous"
        ]
        assert len(second) == 2, f"{client}: {[r['key'] for r in records]}"
