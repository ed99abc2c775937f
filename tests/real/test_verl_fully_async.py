"""verl 0.9.1's fully asynchronous trainer traced by the override alone, on CPU: real verl, real
Ray, real vLLM.

`verl_harness/fully_async.py`, in verl's venv, drives verl's `FullyAsyncRollouter` as
`fully_async_main` drives it (its config from `fully_async_ppo_trainer.yaml` plus the plugin's
`agent_loop_manager_class` override, verl's message queue, weight syncs between the trainer's
batches), with trace-proxy visible to verl as an installed distribution is: through the
`verl.plugins` entry point pyproject.toml declares. The rollouter builds its manager in code and
ignores the key; the entry point's hook is what makes the override reach it. The stand-ins are
verl's GPU server actors (`verl_harness/cpu_replica.py`, `server.py`) and the trainer's GPU
side (a loop that takes samples from verl's queue and syncs the servers' version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import RealServer
from .verl_run import FULLY_ASYNC_RUN

PROMPTS = 6
N = 2
KEPT_PER_STEP = 2  # +trace_proxy.max_samples_per_step=2


@pytest.fixture(scope="module")
def fully_async_run(real_vllm: RealServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's work directory: started by the session once verl's run has exited
    (verl_run.py), or here when nothing started it."""
    if not FULLY_ASYNC_RUN.started:
        FULLY_ASYNC_RUN.start(real_vllm, tmp_path_factory.mktemp("verl-fully-async"))
    return FULLY_ASYNC_RUN.wait()


def _records(work: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted((work / "traces").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("record") == "trajectory":
                found.append(record)
    return found


def test_every_rollout_of_the_kept_samples_recorded_at_its_starting_version(
    fully_async_run: Path,
) -> None:
    """Each kept sample's rollouts are recorded, keyed by the policy version at the sample's
    start (verl's batches carry no step), at most N samples per such step, with verl's ids,
    and every generate with the version that produced it: the versions verl itself recorded."""
    result = json.loads((fully_async_run / "fully-async.json").read_text())
    rollouts = result["samples"]
    assert len(rollouts) == PROMPTS * N  # verl's trainer got every rollout
    assert result["versions"] >= 2  # weights were synced while the rollouter ran
    verls: dict[tuple[int, int], dict[str, Any]] = {}  # (index, rollout) -> verl's numbers
    for row in rollouts:
        rollout = sum(1 for key in verls if key[0] == row["index"])
        verls[(row["index"], rollout)] = row
    records = _records(fully_async_run)
    assert records
    steps: dict[int, set[int]] = {}
    for record in records:
        key = record["key"]
        assert key["experiment"] == "cpu-fully-async"
        assert key["sources"]["step"] == "header:X-Rollout-Step"
        assert record["close_reason"] == "done"
        verl = verls[(key["sample_index"], key["rollout_n"])]
        assert key["sample_id"] == verl["uid"]  # verl's uid_sample_{epoch}_{k}
        # the step: the version at the sample's start (verl's -1 replaced), never after the
        # version its first generate ran on
        assert 0 <= key["step"] <= verl["min"]
        # every generate with its version; the sample's oldest and newest as verl's own
        versions = [int(call["weight_version"]) for call in record["calls"]]
        assert all(verl["min"] <= v <= verl["max"] for v in versions)
        assert int(record["weight_version_min"]) == verl["min"]
        assert int(record["weight_version_max"]) == verl["max"]
        assert record["partial_rollout"] == (verl["min"] != verl["max"])
        steps.setdefault(key["step"], set()).add(key["sample_index"])
    for step, kept in steps.items():
        assert len(kept) <= KEPT_PER_STEP, step  # N per step on the version axis
    assert len(steps) >= 2  # more than one step: not N for the whole run
    per_sample: dict[int, int] = {}
    for record in records:
        index = record["key"]["sample_index"]
        per_sample[index] = per_sample.get(index, 0) + 1
    assert set(per_sample.values()) == {N}  # whole groups: every rollout of a kept sample
    lags = [int(r["weight_version_max"]) - r["key"]["step"] for r in records]
    assert min(lags) >= 0


def test_without_the_override_verls_own_manager(fully_async_run: Path) -> None:
    """The hook is in place, and without the override the name builds verl's own manager,
    worker and client, untouched."""
    untouched = json.loads((fully_async_run / "fully-async.json").read_text())["untouched"]
    assert untouched == {"hooked": True, "manager_is_verls": True, "client_is_verls": True,
                         "workers_are_verls": "AgentLoopWorker"}  # fmt: skip


def test_a_verl_that_honours_the_key_gets_the_manager_built_once(fully_async_run: Path) -> None:
    """If verl's rollouter awaited the key's class (verl PR #6565), the plugin tells the fully
    async manager from what verl hands it and builds it over verl's class, never over the
    stand-in the entry point put under verl's name (no manager wrapped twice)."""
    classes = json.loads((fully_async_run / "fully-async.json").read_text())["honoured_key"]
    verls = "verl.experimental.fully_async_policy.fully_async_rollouter.FullyAsyncAgentLoopManager"
    assert classes[0].endswith(".TracedFullyAsyncAgentLoopManager")
    assert classes[1:3] == [verls, "verl.experimental.agent_loop.agent_loop.AgentLoopManager"]
