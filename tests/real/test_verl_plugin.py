"""verl 0.9.1's agent loop traced by configuration alone, on CPU: real verl, real Ray, real vLLM.

A full `main_ppo` cannot run here (its FSDP actor and its vLLM server actors need GPUs), so
`verl_harness/run.py`, in verl's own venv, drives the agent-loop manager exactly as verl's
legacy trainer does: verl's config composed from its `ppo_trainer.yaml` with overrides, the
manager class loaded by verl's `load_class_from_fqn` from
`actor_rollout_ref.rollout.agent.agent_loop_manager_class` and built with `create(...)`, verl's
real agent-loop workers (single-turn and tool agent loops, n = 2), load balancer, LLM client
and reward-loop workers (a custom reward function), two training steps and a validation pass.
The same is done for verl's default (v1) trainer's manager, `AgentLoopManagerTQ`: one row per
prompt, n sessions, outputs read back from TransferQueue as its replay buffer reads them; its
plugin manager uses the first one's proxy by URL, as with a sidecar.
v1's asynchronous trainers (`colocate_async`, `separate_async`) are run as well: their manager
and `FullyAsyncLLMServerClient` across two weight syncs that abort generations in flight and
resume them on the new version (`verl_harness/partial.py`), with verl's own staleness and
partial-rollout metrics computed on both runs. So is verl's one-step-off-policy trainer
(`verl_harness/offpolicy.py`): its own methods build the manager from the same key (the legacy
manager, the plain client) and run three steps, each batch generated while the trainer holds
the last, one sync forced while the next batch's generations wait at the server's gate.
The one stand-in is verl's GPU server actor (`verl_harness/server.py`; for one-step-off also
what the trainer's GPU server manager and checkpoint engine do to it), which asks the real vLLM
CPU server token-in/token-out and pauses and resumes it at a sync as verl's server does. The
same batches are generated twice, by verl's own manager and through the plugin (which starts
its own trace-proxy), and compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import RealServer
from .verl_run import VERL_RUN

STEPS = (1, 2)
SAMPLES = 4  # three single-turn prompts, then one that gets the tool
N = 2
TOOL_SAMPLE = 3


def _records(work: Path, trainer: str) -> list[dict[str, Any]]:
    """The trajectories of one trainer's run: both runs share the proxy the first started."""
    return _records_of(work, "cpu-agent-loop" + ("-v1" if trainer else ""))


def _records_of(work: Path, experiment: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted((work / "traces").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("record") == "trajectory" and record["key"]["experiment"] == experiment:
                found.append(record)
    return found


@pytest.fixture(scope="module")
def verl_run(real_vllm: RealServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's work directory: started by the session beside the unit tests (verl_run.py),
    or here when nothing started it."""
    if not VERL_RUN.started:
        VERL_RUN.start(real_vllm, tmp_path_factory.mktemp("verl"))
    return VERL_RUN.wait()


TRAINERS = pytest.mark.parametrize(
    "trainer", ["", "v1-"], ids=["legacy (AgentLoopManager)", "v1 (AgentLoopManagerTQ)"]
)


@TRAINERS
def test_batches_equal_verls_own(verl_run: Path, trainer: str) -> None:
    """verl gets back exactly what its own path gives: responses, masks, log probs, rewards,
    turns, the global_steps it expects; and the plugin's calls all went over HTTP."""
    own = json.loads((verl_run / f"batches-{trainer}verl.json").read_text())
    traced = json.loads((verl_run / f"batches-{trainer}plugin.json").read_text())
    for name in ("step1", "step2", "validate"):
        assert own[name]["responses"]
        for field, value in own[name].items():
            assert traced[name][field] == value, (name, field)
    assert own["step1"]["num_turns"][TOOL_SAMPLE * N] > 2  # the tool loop did run a tool
    assert own["server_calls"] > 0  # verl's own path reached its server actor
    assert traced["server_calls"] == 0  # every generate of the plugin went through the proxy


@TRAINERS
def test_store_holds_every_rollout_with_verls_numbers(verl_run: Path, trainer: str) -> None:
    traced = json.loads((verl_run / f"batches-{trainer}plugin.json").read_text())
    records = _records(verl_run, trainer)
    vllm_url = (verl_run / "vllm-url").read_text()
    keys = sorted(
        (r["key"]["step"], r["key"]["validate"], r["key"]["sample_index"], r["key"]["rollout_n"])
        for r in records
    )
    expected = sorted(
        [(step, False, sample, n) for step in STEPS for sample in range(SAMPLES) for n in range(N)]
        + [(STEPS[-1], True, sample, 0) for sample in range(SAMPLES)]
    )
    assert keys == expected  # one trajectory per (step, sample, rollout), validate on the pass
    rewards = {("validate" if v else f"step{s}", i, n): None for s, v, i, n in keys}
    for record in records:
        key = record["key"]
        assert key["project"] == "verl-plugin-test"
        for field in ("step", "sample_index", "rollout_n", "validate", "trajectory_id"):
            assert key["sources"][field].startswith("header:X-Rollout-"), field
        assert record["close_reason"] == "done"  # closed when verl's agent-loop run ended
        name = "validate" if key["validate"] else f"step{key['step']}"
        rewards[(name, key["sample_index"], key["rollout_n"])] = record["reward"]
        # Each call went to the server verl's load balancer chose (the only one here).
        assert {call["upstream"] for call in record["calls"]} == {vllm_url}
    # The reward verl computed is the one recorded, row by row (rows: sample-major, n each).
    for name in ("step1", "step2", "validate"):
        n = 1 if name == "validate" else N
        for row, score in enumerate(traced[name]["rm_scores"]):
            assert rewards[(name, row // n, row % n)] == pytest.approx(score, abs=1e-6)


@TRAINERS
def test_tool_turns_are_tool_spans(verl_run: Path, trainer: str) -> None:
    """With only the documented overrides: verl's own `trace.token2text` stays at its default
    (false), and the local model directory's tokenizer decodes the calls all the same."""
    records = [r for r in _records(verl_run, trainer) if r["key"]["sample_index"] == TOOL_SAMPLE]
    assert records
    for record in records:
        assert len(record["calls"]) == 2  # the call that asked for the tool, and the next turn
        [tool] = record["tools"]
        assert tool["name"] == "word_count"
        assert json.loads(tool["arguments"]) == {"text": "one two three"}
        assert "3 words" in tool["result"]  # what verl's tool returned, seen in the next prompt
        assert record["calls"][0]["end"] <= tool["start"] <= tool["end"]
        assert tool["end"] <= record["calls"][1]["start"]
    single = [r for r in _records(verl_run, trainer) if r["key"]["sample_index"] != TOOL_SAMPLE]
    assert all(len(r["calls"]) == 1 and not r["tools"] for r in single)


# Asynchronous training: v1's async trainers' manager and client across weight syncs
# (verl_harness/partial.py): batch A started on version 0 and aborted mid-generation by the
# sync to 1, batch B started on 1, both aborted mid-generation by the sync to 2, batch C on 2.
PARTIAL_EXPERIMENT = "cpu-partial-rollout"
VERSIONS_BY_BATCH = {"A": ["0", "1", "2"], "B": ["1", "2"], "C": ["2"]}


def test_partial_rollouts_give_verl_its_own_batches_and_metrics(verl_run: Path) -> None:
    """Generations aborted at weight syncs and resumed on new weights: with the plugin, verl
    gets the same tokens, masks, log probs and the same oldest and newest version of each
    sample as without it, so its staleness (v1 `_compute_metrics`) and partial-rollout
    (`detach_utils`) metrics are the same numbers."""
    own = json.loads((verl_run / "partial-async-verl.json").read_text())
    traced = json.loads((verl_run / "partial-async-plugin.json").read_text())
    fields = ("batches", "prompts", "responses", "response_mask", "rollout_log_probs",
              "min_global_steps", "max_global_steps", "v1_metrics", "partial_stats")  # fmt: skip
    for field in fields:
        assert traced[field] == own[field], field
    # The schedule ran as planned on verl's own path: versions as the syncs set them.
    spans = {(b, lo, hi) for b, lo, hi in zip(own["batches"], own["min_global_steps"],
                                              own["max_global_steps"], strict=True)}  # fmt: skip
    assert spans == {("A", 0, 2), ("B", 1, 2), ("C", 2, 2)}
    assert own["partial_stats"]["fully_async/partial/total_partial_num"] == 8
    assert own["v1_metrics"]["training/off_policy/trajectory_spans/max"] == 3


def test_each_resumed_call_is_stored_once_with_its_attempts_and_versions(verl_run: Path) -> None:
    """One call per rollout, its attempts in order, each with the version the server had at
    that attempt, the tokens carried over and why it stopped; the trajectory's sample id,
    oldest and newest version and partial flag are verl's."""
    traced = json.loads((verl_run / "partial-async-plugin.json").read_text())
    verl_rows = {}
    for row, uid in enumerate(traced["uids"]):
        verl_rows[(uid, row % 2)] = row  # sample-major, sessions in order
    records = _records_of(verl_run, PARTIAL_EXPERIMENT)
    assert len(records) == len(verl_rows)
    for record in records:
        key = record["key"]
        row = verl_rows[(key["sample_id"], key["rollout_n"])]
        batch = traced["batches"][row]
        [call] = record["calls"]  # every attempt merged into the one call verl made
        versions = VERSIONS_BY_BATCH[batch]
        alone = {"weight_version": call["weight_version"], "carried_tokens": 0,
                 "finish_reason": call["outputs"][0]["finish_reason"]}  # fmt: skip
        attempts = call["segments"] or [alone]
        assert [a["weight_version"] for a in attempts] == versions
        assert [a["finish_reason"] for a in attempts] == ["abort"] * (len(versions) - 1) + [
            "length"]  # fmt: skip
        carried = 0
        for attempt in attempts:
            assert attempt["carried_tokens"] == carried
            carried += attempt.get("tokens", len(call["outputs"][0]["token_ids"]))
        for attempt in attempts[:-1]:
            assert attempt["tokens"] > 0  # aborted mid-generation, its tokens carried over
        generated = call["outputs"][0]["token_ids"]
        response = traced["responses"][row]
        assert generated == response[: len(generated)] and len(generated) == carried
        assert call["weight_version"] == versions[-1]
        assert (record["weight_version_min"], record["weight_version_max"]) == (
            str(traced["min_global_steps"][row]), str(traced["max_global_steps"][row]))  # fmt: skip
        assert record["partial_rollout"] is (batch != "C")
        assert key["sources"]["sample_id"] == "header:X-Rollout-Sample-Id"


# One-step-off-policy (verl_harness/offpolicy.py): batch A (tagged step 1) on version 0, B
# (step 1: started before the trainer's step ends) on 1, C (step 2) sent while the sync to 2
# held the server's gate closed, on 2.
OFFPOLICY_EXPERIMENT = "cpu-one-step-off"
OFFPOLICY_BATCHES = {"A": (1, 0), "B": (1, 1), "C": (2, 2)}  # step tag, version


def test_one_step_off_policy_gives_verl_its_own_batches_and_metrics(verl_run: Path) -> None:
    """Each batch generated on the version synced before it started (not the version of its
    step's first batch, nor the one before the sync its calls waited behind): with the plugin,
    verl gets the same tokens, masks, log probs, rewards and versions of each sample, and so
    logs the same numbers of each batch (`compute_data_metrics`)."""
    own = json.loads((verl_run / "offpolicy-offpolicy-verl.json").read_text())
    traced = json.loads((verl_run / "offpolicy-offpolicy-plugin.json").read_text())
    fields = ("batches", "prompts", "responses", "response_mask", "attention_mask",
              "rollout_log_probs", "rm_scores", "num_turns", "min_global_steps",
              "max_global_steps", "global_steps", "metrics")  # fmt: skip
    for field in fields:
        assert traced[field] == own[field], field
    # The schedule ran as planned on verl's own path: each batch on its sync's version.
    spans = {(b, lo, hi) for b, lo, hi in zip(own["batches"], own["min_global_steps"],
                                              own["max_global_steps"], strict=True)}  # fmt: skip
    assert spans == {(b, v, v) for b, (_, v) in OFFPOLICY_BATCHES.items()}
    assert own["server_calls"] > 0  # verl's own path reached its server actor
    assert traced["server_calls"] == 0  # every generate of the plugin went through the proxy


def test_one_step_off_policy_stores_each_call_with_its_servers_version(verl_run: Path) -> None:
    """One call per rollout, with the version the server had when it was admitted; the
    trajectory carries verl's step tag and sample id, and is not a partial rollout."""
    traced = json.loads((verl_run / "offpolicy-offpolicy-plugin.json").read_text())
    rows: dict[tuple[str, int], int] = {}
    for row, uid in enumerate(traced["uids"]):  # n consecutive rows per sample
        rows[(uid, sum(1 for u in traced["uids"][:row] if u == uid))] = row
    records = _records_of(verl_run, OFFPOLICY_EXPERIMENT)
    assert len(records) == len(rows)
    for record in records:
        key = record["key"]
        row = rows[(key["sample_id"], key["rollout_n"])]
        step, version = OFFPOLICY_BATCHES[traced["batches"][row]]
        assert key["step"] == step
        [call] = record["calls"]
        assert not call["segments"]  # one attempt: no sync stopped it
        assert call["weight_version"] == str(version)
        assert (record["weight_version_min"], record["weight_version_max"]) == (
            str(version), str(version))  # fmt: skip
        assert record["partial_rollout"] is False
        assert record["close_reason"] == "done"
        generated = call["outputs"][0]["token_ids"]
        length = sum(traced["response_mask"][row])
        assert generated == traced["responses"][row][:length] and len(generated) == length
