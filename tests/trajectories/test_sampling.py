"""Sampling through the proxy: whole groups kept by keyed hash, the rest never recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from fakes import FakeVLLM
from support.proxies import metric, running_proxy, trajectories

from trace_proxy.config import resolve
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.sampler import sample_hash

SAMPLES, ROLLOUTS, TURNS = 10, 2, 2


async def rollouts(
    proxy: str, step: int, validate: bool = False, interleaved: bool = False
) -> None:
    """Each rollout's turns in a row; `interleaved`: every rollout's first turn, then every
    second turn (as a batched agent loop sends them)."""
    plan = [(sample, rollout, turn) for sample in range(SAMPLES) for rollout in range(ROLLOUTS)
            for turn in range(TURNS)]  # fmt: skip
    if interleaved:
        plan.sort(key=lambda call: call[2])
    async with aiohttp.ClientSession() as session:
        for sample, rollout, turn in plan:
            headers = {"X-Rollout-Experiment": "exp", "X-Rollout-Step": str(step),
                       "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": str(rollout),
                       "X-Rollout-Validate": str(validate).lower()}  # fmt: skip
            body = {"model": "tiny-qwen", "prompt": [sample, rollout, turn] * 8,
                    "max_tokens": 3}  # fmt: skip
            async with session.post(
                proxy + "/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200


def summaries(output: Path) -> list[dict[str, Any]]:
    return [r for _, r in iter_records(output) if r.get("record") == "step_summary"]


def kept_samples(output: Path, step: int) -> set[int]:
    return {t["key"]["sample_index"] for t in trajectories(output) if t["key"]["step"] == step}


async def test_top_n_keeps_the_smallest_hashes_with_all_their_rollouts(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, max_samples_per_step=3, sample_seed=11) as (
        service,
        proxy,
    ):
        await rollouts(proxy, step=1)
        await rollouts(proxy, step=2)
        metrics = service.metrics
    for step in (1, 2):
        ranked = sorted(range(SAMPLES), key=lambda s: sample_hash(11, "exp", step, False, s))
        assert kept_samples(tmp_path, step) == set(ranked[:3])
        kept = [t for t in trajectories(tmp_path) if t["key"]["step"] == step]
        assert len(kept) == 3 * ROLLOUTS and all(len(t["calls"]) == TURNS for t in kept)
    by_step = {s["step"]: s for s in summaries(tmp_path)}
    for step in (1, 2):
        summary = by_step[step]
        assert summary["trajectories_seen"] == SAMPLES * ROLLOUTS
        assert summary["trajectories_kept"] == 3 * ROLLOUTS
        assert summary["trajectories_dropped_by_sampler"] == (SAMPLES - 3) * ROLLOUTS
        assert summary["calls_seen"] == SAMPLES * ROLLOUTS * TURNS
        assert summary["calls_kept"] == 3 * ROLLOUTS * TURNS
    # Most dropped calls were refused from their headers, before their bodies were parsed.
    refused = metric(metrics, "trace_proxy_capture_dropped_total", reason="sampler")
    assert refused > 0


@pytest.mark.parametrize("capture_mode", ["process", "inline"])
async def test_interleaved_rollouts_are_each_counted_once(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, capture_mode: str
) -> None:
    """A sample pushed out of the kept set after its first turns: its later turns are refused
    as they arrive, its earlier turns dropped when its trajectory closes; the step summary
    counts its trajectory once, as seen and as dropped."""
    _, upstream = fake_vllm
    settings = {"max_samples_per_step": 3, "sample_seed": 11, "capture_mode": capture_mode}
    async with running_proxy([upstream], tmp_path, **settings) as (_, proxy):
        await rollouts(proxy, step=1, interleaved=True)
        await rollouts(proxy, step=2)
    ranked = sorted(range(SAMPLES), key=lambda s: sample_hash(11, "exp", 1, False, s))
    assert kept_samples(tmp_path, 1) == set(ranked[:3])
    pushed_out = [s for s in range(SAMPLES) if s not in ranked[:3]
                  and sorted(range(s + 1), key=lambda x: sample_hash(11, "exp", 1, False, x))
                  .index(s) < 3]  # fmt: skip
    assert pushed_out, "the seed should push a sample out after its first turn"
    summary = next(s for s in summaries(tmp_path) if s["step"] == 1)
    outcomes = ("seen", "kept", "dropped_by_sampler")
    for what, per_rollout in (("trajectories", 1), ("calls", TURNS)):
        counts = [summary[f"{what}_{outcome}"] for outcome in outcomes]
        expected = [SAMPLES * ROLLOUTS, 3 * ROLLOUTS, (SAMPLES - 3) * ROLLOUTS]
        assert counts == [n * per_rollout for n in expected], what


async def test_rate_mode_and_a_separate_validation_policy(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    settings = {"sample_rate": 0.5, "sample_seed": 3, "validate_max_samples_per_step": 0}
    async with running_proxy([upstream], tmp_path, **settings) as (_, proxy):
        await rollouts(proxy, step=1)
        await rollouts(proxy, step=1, validate=True)
    expected = {s for s in range(SAMPLES) if sample_hash(3, "exp", 1, False, s) < 0.5}
    assert kept_samples(tmp_path, 1) == expected
    assert not any(t["key"]["validate"] for t in trajectories(tmp_path))
    validation = next(s for s in summaries(tmp_path) if s["validate"])
    assert validation["trajectories_kept"] == 0
    assert validation["calls_seen"] == SAMPLES * ROLLOUTS * TURNS


async def test_without_sampling_every_step_is_summarised(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        await rollouts(proxy, step=1)
        await rollouts(proxy, step=2)
    assert len(trajectories(tmp_path)) == 2 * SAMPLES * ROLLOUTS
    assert [(s["step"], s["trajectories_kept"]) for s in summaries(tmp_path)] == [
        (1, SAMPLES * ROLLOUTS),
        (2, SAMPLES * ROLLOUTS),
    ]
    lines = (tmp_path / "default/exp/steps.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["step"] for line in lines] == [1, 2]


def test_verl_option_names_and_exclusive_modes(tmp_path: Path) -> None:
    config = tmp_path / "verl.yaml"
    config.write_text(
        "trace:\n  backend: mlflow\n  token2text: true\n  max_samples_per_step_per_worker: 4\n"
        "  project_name: verl_grpo\n  experiment_name: qwen3-run\n"
    )  # actor_rollout_ref.rollout.trace, as verl writes it
    settings = resolve("serve", {"config": str(config)}, {})
    assert (settings.max_samples_per_step, settings.token2text) == (4, True)
    assert (settings.backend, settings.project, settings.experiment) == (
        ["mlflow"],
        "verl_grpo",
        "qwen3-run",
    )
    with pytest.raises(ValueError, match="either"):
        resolve("serve", {"max_samples_per_step": "2", "sample_rate": "0.5"}, {})
