"""Rewards posted to the admin port land on the trajectory, wherever it is by then."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeVLLM
from support.proxies import running_proxy, trajectories
from support.stores import annotation, append, run_dir, step_file, trajectory

from trace_proxy.client import RewardRejected, post_reward
from trace_proxy.show import show
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.record import RolloutKey, Trajectory
from trace_proxy.trajectories.rewards import Outcome, apply, merged_outcome
from trace_proxy.ui.index import StoreIndex


async def generate(proxy: str, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny-qwen", "prompt": [1, 2, 3, 4], "max_tokens": 3}
        async with session.post(proxy + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200


def key(step: int, sample: int, rollout: int = 0) -> dict[str, str]:
    return {"X-Rollout-Experiment": "exp", "X-Rollout-Step": str(step),
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": str(rollout)}  # fmt: skip


async def reward(admin: str, **fields: Any) -> str:
    """The helper is synchronous (for training code): call it off the proxy's event loop."""
    return await asyncio.to_thread(post_reward, admin, **fields)


async def test_rewards_while_open_after_export_and_for_unknown_trajectories(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    # Synchronous RL: a step's trajectories close as soon as the next step starts.
    async with running_proxy([upstream], tmp_path, step_close_grace=0) as (service, proxy):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        await generate(proxy, key(1, 0))
        await generate(proxy, {**key(1, 1), "X-Rollout-Trajectory-Id": "t-1"})
        await service.flush()
        assert await reward(admin, reward=1.0, experiment="exp", step=1, sample_index=0,
                            rollout_n=0, labels={"correct": True}) == "open"  # fmt: skip
        await generate(proxy, key(2, 0))  # step 2 starts: step 1 is closed and exported
        await service.flush()
        assert await reward(admin, score=0.25, trajectory_id="t-1") == "exported"
        assert await reward(admin, reward=-1.0, experiment="exp", step=9, sample_index=4) == (
            "unknown"
        )
    by_sample = {(t["key"]["step"], t["key"]["sample_index"]): t for t in trajectories(tmp_path)}
    assert by_sample[(1, 0)]["reward"] == 1.0
    assert by_sample[(1, 0)]["labels"] == {"correct": True}
    assert by_sample[(1, 1)]["score"] is None  # exported before the score: see its annotation
    notes = [r for _, r in iter_records(tmp_path) if r.get("record") == "annotation"]
    late = next(n for n in notes if n["target"] == {"trajectory_id": "t-1"})
    assert late["trajectories"] == [by_sample[(1, 1)]["id"]] and late["score"] == 0.25
    assert (tmp_path / "default/exp/step-000001.jsonl").read_text().count('"annotation"') == 1
    unknown = next(n for n in notes if n["target"].get("step") == 9)
    assert unknown["trajectories"] == [] and unknown["reward"] == -1.0
    out = io.StringIO()
    show(tmp_path, out=out)
    text = out.getvalue()
    assert "step 1 · sample 0 · rollout 0" in text and "reward 1, correct=True" in text
    assert "score 0.25" in text
    assert "no such trajectory stored here" in text


async def test_a_reward_posted_as_soon_as_the_answer_came_back_lands_on_its_trajectory(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    """A trainer posts a rollout's reward the moment its last answer is back, before the proxy
    has parsed that call: the reward waits for the calls forwarded before it (`queued`), then
    lands on the trajectory, never as an annotation that names none."""
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, step_close_grace=0) as (service, proxy):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        for sample in range(6):
            await generate(proxy, key(1, sample))
            where = await reward(admin, reward=float(sample), experiment="exp", step=1,
                                 sample_index=sample, rollout_n=0)  # fmt: skip
            assert where in ("open", "queued")
        await generate(proxy, key(2, 0))  # step 1 ends
        await service.flush()
    records = [r for _, r in iter_records(tmp_path)]
    rewards = {r["key"]["sample_index"]: r["reward"] for r in records
               if r.get("record") == "trajectory" and r["key"]["step"] == 1}  # fmt: skip
    assert rewards == {sample: float(sample) for sample in range(6)}
    assert not [r for r in records if r.get("record") == "annotation"]


async def test_a_reward_for_a_sampling_candidate_waits_with_it(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, max_samples_per_step=100) as (service, proxy):
        assert service.addresses is not None and service.addresses.admin is not None
        headers = {**key(1, 0), "X-Rollout-Done": "true"}
        await generate(proxy, headers)
        await service.flush()
        where = await reward(
            service.addresses.admin, reward=0.5, experiment="exp", step=1, sample_index=0,
            rollout_n=0,
        )  # fmt: skip
        assert where == "waiting"
    [trajectory] = trajectories(tmp_path)
    assert trajectory["reward"] == 0.5


async def test_bad_requests_and_the_admin_token(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, admin_token="s3cret") as (service, _):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        with pytest.raises(RewardRejected, match="401"):
            await reward(admin, reward=1.0, trajectory_id="x")
        assert await reward(admin, reward=1.0, trajectory_id="x", token="s3cret") == "unknown"
        for fields, message in (
            ({"reward": 1.0}, "name the trajectory"),
            ({"trajectory_id": "x"}, "nothing to attach"),
            ({"trajectory_id": "x", "reward": "high"}, "'reward' must be a number"),
            ({"sample_index": -1, "reward": 1}, "non-negative"),
        ):
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    admin + "/rewards", json=fields, headers={"Authorization": "Bearer s3cret"}
                ) as response:
                    assert response.status == 400
                    assert message in (await response.json())["error"]
    assert b"s3cret" not in b"".join(p.read_bytes() for p in tmp_path.rglob("*.jsonl"))


def test_a_late_reward_is_merged_one_way_by_every_reader(tmp_path: Path) -> None:
    """`show`, the viewer and a trajectory waiting for its step apply later posts alike: the
    latest reward and score given win, labels add up (a note's over the record's)."""
    notes: list[dict[str, Any]] = [
        {"reward": 1.0, "score": None, "labels": {"b": 2}},
        {"reward": None, "score": 0.5, "labels": {"c": 3}},
        {"reward": 0.25, "score": None, "labels": {}},
    ]
    expected = {"reward": 0.25, "score": 0.5, "labels": {"a": 1, "b": 2, "c": 3}}
    record: dict[str, Any] = {"reward": 0.0, "score": None, "labels": {"a": 1, "b": 1}}
    for note in notes:  # as `show` applies them
        record.update(merged_outcome(record, note))
    assert record == expected

    key = RolloutKey(project="proj", experiment="exp", step=1, sample_index=0)
    waiting = Trajectory(id="w", key=key, start=1.0, end=2.0, status="ok", close_reason="done",
                         calls=[], reward=0.0, labels={"a": 1, "b": 1})  # fmt: skip
    for note in notes:
        apply(waiting, Outcome({}, **note))
    assert {"reward": waiting.reward, "score": waiting.score, "labels": waiting.labels} == expected

    stored = trajectory(reward=0.0, labels={"a": 1, "b": 1})
    path = step_file(run_dir(tmp_path), 1)
    append(path, stored, *({**annotation([stored["id"]], 0.0), **note} for note in notes))
    index = StoreIndex([tmp_path])
    index.refresh(force=True)
    [run] = index.runs.values()
    entry = run.by_id[stored["id"]]
    record = index.read_record(entry)
    assert {name: record[name] for name in expected} == expected
    # The viewer reads a store as it is: what is not a number is no reward.
    append(path, {**annotation([stored["id"]], 0.0), "reward": "high"})
    index.refresh(force=True)
    assert entry.reward == expected["reward"]
