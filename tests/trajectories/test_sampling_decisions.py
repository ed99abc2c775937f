"""One sampling decision per step, whatever the number of proxies: whoever sees a step's whole
batch (verl's agent-loop manager) names its kept samples on every proxy's admin port, and the
proxies keep exactly those, wherever each rollout's calls went.

Two real proxies in front of the fake vLLM; calls of one step are spread over both as a router
that is not sticky would spread them.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
from support.proxies import metric, running_proxy, trajectories

from trace_proxy.processes.capture import CaptureProcess
from trace_proxy.show import show
from trace_proxy.trajectories.sampler import Policy, Sampler, sample_hash
from trace_proxy.ui.index import StoreIndex

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GUARD = 60.0  # seconds: a failure bound, not a synchronisation
SAMPLES, ROLLOUTS, N = 8, 2, 2


def headers(step: int, sample: int, rollout: int, validate: bool = False) -> dict[str, str]:
    return {"X-Rollout-Experiment": "exp", "X-Rollout-Step": str(step),
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": str(rollout),
            "X-Rollout-Validate": str(validate).lower(), "X-Rollout-Done": "true"}  # fmt: skip


async def call(session: aiohttp.ClientSession, proxy: str, **key: Any) -> None:
    body = {"model": "tiny-qwen", "prompt": [1, 2, 3, key["sample"]], "max_tokens": 4}
    async with session.post(proxy + "/v1/completions", json=body, headers=headers(**key)) as r:
        assert r.status == 200
        await r.read()


async def decide(session: aiohttp.ClientSession, admin: str, **decision: Any) -> Any:
    async with session.post(admin + "/sampling", json=decision, headers=AUTH) as response:
        return response.status, await response.json()


def kept_keys(*outputs: Path) -> list[tuple[int, int, int]]:
    return sorted(
        (t["key"]["step"], t["key"]["sample_index"], t["key"]["rollout_n"])
        for output in outputs
        for t in trajectories(output)
    )


def summaries(output: Path) -> list[dict[str, Any]]:
    import orjson

    return [orjson.loads(line) for path in output.rglob("steps.jsonl")
            for line in path.read_bytes().splitlines()]  # fmt: skip


async def test_two_proxies_keep_exactly_the_samples_the_manager_chose(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """Each proxy writes its replica directory of one output, read back as one store."""
    _, upstream = fake_vllm
    output = tmp_path / "run"
    replicas = output / "replicas"
    options = {"admin_token": TOKEN, "max_samples_per_step": N, "capture_mode": "inline",
               "export_mode": "inline"}  # fmt: skip
    chosen = [6, 1]  # not what either proxy's own top-N would keep: the manager decides
    async with (
        running_proxy([upstream], replicas / "a", **options) as (a, proxy_a),
        running_proxy([upstream], replicas / "b", **options) as (b, proxy_b),
        aiohttp.ClientSession() as session,
    ):
        for service in (a, b):
            assert service.addresses is not None and service.addresses.admin is not None
            admin = service.addresses.admin
            answer = await decide(session, admin, experiment="exp", step=1, kept=chosen)
            assert answer == (200, {"kept": 2})
        for sample in range(SAMPLES):
            for rollout in range(ROLLOUTS):  # rollouts of one sample on both proxies
                proxy = (proxy_a, proxy_b)[(sample + rollout) % 2]
                await call(session, proxy, step=1, sample=sample, rollout=rollout)
        for proxy in (proxy_a, proxy_b):  # the next step ends step 1 on both
            await call(session, proxy, step=2, sample=0, rollout=0)
        await a.flush()
        await b.flush()
        name = "trace_proxy_sampled_total"
        dropped = sum(
            metric(s.metrics, name, what="trajectories", outcome="dropped_by_sampler")
            for s in (a, b)
        )
    step_one = [key for key in kept_keys(replicas / "a", replicas / "b") if key[0] == 1]
    assert step_one == sorted((1, s, r) for s in chosen for r in range(ROLLOUTS))
    assert dropped == (SAMPLES - len(chosen)) * ROLLOUTS
    seen = [s for out in ("a", "b") for s in summaries(replicas / out) if s.get("step") == 1]
    assert len(seen) == 2  # each replica summarises what it saw of the step
    # `show` and the viewer read the output as one store: one run, one summary per step
    printed = io.StringIO()
    assert show(output, out=printed) == 0
    lines = printed.getvalue().splitlines()
    [step_line] = [line for line in lines if line.startswith("-- step 1:")]
    assert step_line.startswith(f"-- step 1: {SAMPLES * ROLLOUTS} trajectories "
                                f"({len(chosen) * ROLLOUTS} kept, ")  # fmt: skip
    assert sum(line.startswith("== default/exp · step 1 ") for line in lines) == 4
    index = StoreIndex([output], min_interval=0)
    index.refresh(force=True)
    [run] = index.runs.values()
    step = run.steps[(False, 1)]
    assert step.summary is not None and step.summary["trajectories_kept"] == 4
    assert step.summary["trajectories_seen"] == SAMPLES * ROLLOUTS
    assert sorted(e.sample_index for e in step.entries) == sorted(chosen * ROLLOUTS)


async def test_a_decision_needs_the_token_a_valid_body_and_a_top_n_policy(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with (
        running_proxy(
            [upstream],
            tmp_path,
            admin_token=TOKEN,
            max_samples_per_step=N,
            capture_mode="inline",
            export_mode="inline",
        ) as (service, _),  # fmt: skip
        aiohttp.ClientSession() as session,
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        body = {"experiment": "exp", "step": 1, "kept": [1]}
        async with session.post(admin + "/sampling", json=body) as response:
            assert response.status == 401
        for bad in ({"experiment": "exp", "step": "1", "kept": [1]},
                    {"experiment": "exp", "step": 1, "kept": 3},
                    {"experiment": "exp", "step": 1, "kept": [True]},
                    {"experiment": "", "step": 1, "kept": []},
                    {"experiment": "exp", "step": 1, "kept": [], "extra": 1}):  # fmt: skip
            status, answer = await decide(session, admin, **bad)
            assert status == 400 and answer["error"]
        # validation steps keep every sample here: nothing to decide
        status, answer = await decide(session, admin, experiment="exp", step=1, validate=True,
                                      kept=[1])  # fmt: skip
        assert status == 409 and "--validate-max-samples-per-step" in answer["error"]


async def test_a_restarted_capture_process_is_told_the_decisions_again(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, admin_token=TOKEN, max_samples_per_step=1) as (
            service, proxy),
        aiohttp.ClientSession() as session,
    ):  # fmt: skip
        assert service.addresses is not None and service.addresses.admin is not None
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        assert await decide(session, service.addresses.admin, experiment="exp", step=1,
                            kept=[3]) == (200, {"kept": 1})  # fmt: skip
        os.kill(capture.pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GUARD
        while capture.generation < 2 and loop.time() < deadline:
            await asyncio.sleep(0.05)  # the supervisor's restart: nothing to await from here
        await asyncio.wait_for(service.wait_ready(), GUARD)
        for sample in range(SAMPLES):
            await call(session, proxy, step=1, sample=sample, rollout=0)
        await call(session, proxy, step=2, sample=0, rollout=0)
        await asyncio.wait_for(service.flush(), GUARD)
    assert [key for key in kept_keys(tmp_path) if key[0] == 1] == [(1, 3, 0)]


def test_a_step_given_in_parts_keeps_the_union_and_nothing_late() -> None:
    sampler = Sampler(7, train=Policy(max_samples=2))
    assert sampler.give("e", 1, False, [4])
    assert sampler.give("e", 1, False, ["9"])
    fates = {s: sampler.decide("e", 1, False, s)[0].value for s in (4, 9, 2)}
    assert fates == {4: "keep", 9: "keep", 2: "drop"}
    assert sampler.finish_step("e", 1, False) == {"4", "9"}
    # late, with the smallest hash of all: still dropped, the step kept what it was told
    smallest = min(range(10, 200), key=lambda s: sample_hash(7, "e", 1, False, s))
    assert sampler.decide("e", 1, False, smallest)[0].value == "drop"
    assert sampler.decide("e", 1, False, 4)[0].value == "keep"
    assert not Sampler(7).give("e", 1, False, [1])  # keeps everything: nothing to decide
