"""verl 0.9.1's asynchronous rollout across weight syncs, as its v1 async trainers run it.

`trainer.v1.trainer_mode=colocate_async|separate_async` generate with `AgentLoopManagerTQ`
(built from `agent_loop_manager_class`) and `FullyAsyncLLMServerClient`, and sync weights
while generations are in flight: `CheckpointEngineManager.update_weights` aborts every request
on the servers (gate closed, engine paused), sends the weights, calls `set_global_steps`, and
`resume_generation_replicas` resumes the engine and opens the gate; the client sends each
aborted request again with the tokens it has (partial rollout) and keeps the oldest and newest
`global_steps` of each sample, from which verl computes its staleness and partial-rollout
metrics. This runs exactly that with verl's own manager, client, load balancer, TransferQueue
and metric functions; the weight sync is the server actor's abort, `set_global_steps` and
resume (no weights change: the same model generates, so greedy decoding gives the same tokens
on every run). No rollout's progress depends on how fast verl hands a batch over: each batch
waits at the server's closed gate, the gate opens on an engine frozen with vLLM's own
`/pause?mode=keep`, and vLLM resumes once its `/load` counts every rollout's request inside
it, so they all start together; each sync happens when vLLM's own metrics show every rollout
running with tokens, and the engine is frozen at that moment, before verl's abort reaches it.
The schedule is the same on every run:

  version 0: batch A (2 prompts x n=2) started together; once each of its 4 rollouts has
             tokens:
  sync to 1: batch A aborted mid-generation; batch B (4 rollouts) sent while the gate is
             closed; the 4 resumed and the 4 new started together on version 1; once each of
             the 8 has tokens:
  sync to 2: all 8 aborted mid-generation; all finish on version 2; then batch C, on 2.

Each rollout generates `response_length` tokens (`ignore_eos`), so none ends before a sync
(one that does is reported as an error: the schedule would then depend on timing).
Writes WORK/partial-<mode>.json: each rollout's tokens, masks, log probs and min/max version
(verl's TransferQueue tags), and verl's metrics: v1 `PPOTrainer._compute_metrics` at trainer
step 3 and `detach_utils.assemble_batch_from_rollout_samples`'s partial-rollout statistics.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

EXPERIMENT = "cpu-partial-rollout"
PROMPTS = {"A": ["Say hi", "Count to three"], "B": ["Name a colour", "Spell cat"],
           "C": ["Say bye", "Name a fruit"]}  # fmt: skip
N = 2
RESPONSE_LENGTH = 512  # a rollout outlasts the poll that freezes it, on a busy machine
TRAINER_STEP = 3  # the trainer step whose metrics are computed over the three batches
POLL_S = 0.01
WAIT_S = 300.0


def overrides() -> list[str]:
    return [
        f"trainer.experiment_name={EXPERIMENT}",
        "trainer.use_v1=true",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "+trace_proxy.start_timeout=600",  # run alone, on a busy machine, its proxy starts late
    ]


class VllmMetrics:
    """vLLM's own counts: requests running and tokens generated (Prometheus), requests inside
    its HTTP server (`/load`, which counts while the engine is frozen too)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.url = base_url + "/metrics"

    def read(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url, timeout=30) as response:
            text = response.read().decode()
        found: dict[str, float] = {}
        for name in ("num_requests_running", "generation_tokens_total"):
            values = re.findall(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            found[name] = sum(float(v) for v in values)
        ended = re.findall(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} '
                           r"([0-9.e+]+)$", text, re.M)  # fmt: skip
        found["completed"] = sum(float(v) for v in ended)
        return found

    def wait_for(self, what: str, condition: Any, completed: float) -> dict[str, float]:
        """Read until `condition(counts)` holds (vLLM's state, not time, decides). A rollout
        that ran to its end first (more than `completed` requests complete) would make the
        schedule depend on timing: that is an error, not a different run."""
        deadline = time.monotonic() + WAIT_S
        while True:
            counts = self.read()
            if counts["completed"] > completed:
                raise RuntimeError(f"a rollout ended before {what}: too slow a machine for "
                                   f"{RESPONSE_LENGTH} tokens per rollout ({counts})")  # fmt: skip
            if condition(counts):
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM never had {what}: {counts}")
            time.sleep(POLL_S)

    def wait_load(self, what: str, requests: int) -> None:
        """Until vLLM's HTTP server holds exactly `requests` generate requests (`/load`)."""
        deadline = time.monotonic() + WAIT_S
        while (load := self.load()) != requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM never had {what}: {load} requests, not {requests}")
            time.sleep(POLL_S)

    def load(self) -> int:
        with urllib.request.urlopen(self.base_url + "/load", timeout=30) as response:
            return int(json.loads(response.read())["server_load"])

    def post(self, path: str) -> None:
        request = urllib.request.Request(self.base_url + path, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def dispatch(manager: Any, name: str) -> list[str]:
    """One batch as the v1 trainer hands it to its manager (step tag: the trainer's step 1)."""
    import uuid

    import transfer_queue as tq
    from verl.utils import tensordict_utils as tu

    texts = PROMPTS[name]
    uids = [f"{name}-{uuid.uuid4().hex[:8]}" for _ in texts]
    offset = sorted(PROMPTS).index(name) * len(texts)
    batch_dict = {
        "raw_prompt": np.array([[{"role": "user", "content": t}] for t in texts], dtype=object),
        "agent_name": np.array(["single_turn_agent"] * len(texts), dtype=object),
        "index": np.array([offset + i for i in range(len(texts))], dtype=object),
        "data_source": np.array(["cpu-test"] * len(texts), dtype=object),
        "reward_model": np.array([{"ground_truth": "x"}] * len(texts), dtype=object),
        "extra_info": np.array([{"index": offset + i} for i in range(len(texts))], dtype=object),
        "uid": np.array(uids, dtype=object),
    }
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    tu.assign_non_tensor_data(batch, "validate", False)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    manager.generate_sequences(batch)
    return uids


def generating_then_frozen(vllm: VllmMetrics, rollouts: int) -> None:
    """Every rollout in the engine, each with two tokens at least (vLLM schedules them all
    together, one token each per step), none ended; then the engine frozen at once, so the
    sync that follows aborts them where they are, however long a busy machine takes to carry
    verl's abort to the server."""
    done = vllm.read()["completed"]
    running = vllm.wait_for(
        "every rollout running", lambda c: c["num_requests_running"] == rollouts, done
    )
    floor = running["generation_tokens_total"] + 2 * rollouts
    vllm.wait_for("tokens generated", lambda c: c["generation_tokens_total"] >= floor, done)
    vllm.post("/pause?mode=keep")
    vllm.wait_for("the engine froze", lambda c: True, done)


def sync(server: Any, version: int) -> None:
    """`CheckpointEngineManager.update_weights` and `resume_generation_replicas` as the server
    sees them: abort everything (gate closed), set the version, resume (gate open)."""
    close_gate(server)
    open_gate(server, version)


def close_gate(server: Any) -> None:
    ray.get(server.abort_all_requests.remote())


def open_gate(server: Any, version: int) -> None:
    ray.get(server.set_global_steps.remote(version))
    ray.get(server.resume_generation.remote())


def wait_finished(uids: list[str]) -> None:
    import transfer_queue as tq

    deadline = time.monotonic() + WAIT_S
    while True:
        listing = tq.kv_list("train").get("train", {})
        states = [(listing.get(uid) or {}).get("status") for uid in uids]
        if all(state in ("finished", "failure") for state in states):
            assert all(state == "finished" for state in states), states
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollouts still running: {states}")
        time.sleep(0.2)


def started_together(server: Any, vllm: VllmMetrics, rollouts: int, version: int) -> None:
    """The closed gate opened on `version` with the engine frozen, and the engine resumed once
    every rollout's request is inside vLLM: none can run to its end before the last one
    starts, however slowly a busy machine hands them over."""
    ray.get(server.set_global_steps.remote(version))
    ray.get(server.resume_generation_held.remote())
    vllm.wait_load("every rollout's request", rollouts)
    vllm.post("/resume")


def schedule(manager: Any, server: Any, vllm_url: str) -> list[str]:
    """The run above; returns the prompts' uids in batch order."""
    vllm = VllmMetrics(vllm_url)
    close_gate(server)
    uids = dispatch(manager, "A")
    started_together(server, vllm, len(uids) * N, 0)
    generating_then_frozen(vllm, len(uids) * N)
    close_gate(server)  # the sync to 1, whose aborted answers all leave vLLM before B starts
    vllm.wait_load("every aborted request answered", 0)
    uids += dispatch(manager, "B")
    started_together(server, vllm, len(uids) * N, 1)
    generating_then_frozen(vllm, len(uids) * N)
    sync(server, 2)
    wait_finished(uids)
    more = dispatch(manager, "C")
    wait_finished(more)
    return uids + more


def rollouts(uids: list[str]) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
    """Each rollout's key, its TransferQueue tags (verl's min/max versions), its fields."""
    import transfer_queue as tq

    keys = [f"{uid}_{session}_0" for uid in uids for session in range(N)]
    listing = tq.kv_list("train")["train"]
    tags = [dict(listing[key]) for key in keys]
    fields = ["prompts", "responses", "response_mask", "rollout_log_probs", "extra_fields"]
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=fields)
    return keys, tags, data


def v1_metrics(config: Any, keys: list[str], tags: list[dict[str, Any]]) -> dict[str, float]:
    """verl's v1 `PPOTrainer._compute_metrics` over the batch, at trainer step 3. Fields the
    trainer would have computed (values, advantages, returns, rewards) are put as zeros."""
    import transfer_queue as tq
    from transfer_queue.metadata import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    responses = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses"])
    lengths = [len(t) for t in responses["responses"].unbind(0)]
    zeros = [{name: torch.zeros(n) for name in ("values", "advantages", "returns",
                                                 "token_level_rewards")}
             for n in lengths]  # fmt: skip
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(zeros))
    trainer = SimpleNamespace(config=config, use_critic=False,
                              _rollout_moe_lb_metrics_accumulator=None,
                              _get_n_gpus_for_throughput=lambda: 1)  # fmt: skip
    metrics: dict[str, Any] = {}
    batch = KVBatchMeta(partition_id="train", keys=keys, tags=tags)
    PPOTrainer._compute_metrics(trainer, batch, metrics, {"step": 1.0, "gen": 1.0}, TRAINER_STEP, 0)
    return {k: float(v) for k, v in metrics.items() if k.startswith("training/off_policy/")}


def partial_stats(config: Any, data: Any, tags: list[dict[str, Any]]) -> dict[str, Any]:
    """verl's fully-async batch assembly (`detach_utils`) over the same rollouts."""
    from verl import DataProto
    from verl.experimental.fully_async_policy.detach_utils import (
        RolloutSample,
        assemble_batch_from_rollout_samples,
    )

    masks = [t.tolist() for t in data["response_mask"].unbind(0)]
    width = max(len(m) for m in masks)
    padded = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    full = DataProto.from_dict(
        tensors={"response_mask": padded},
        non_tensors={"min_global_steps": np.array([t["min_global_steps"] for t in tags]),
                     "max_global_steps": np.array([t["max_global_steps"] for t in tags])},
        meta_info={"metrics": [{"generate_sequences": 0.0, "tool_calls": 0.0}] * len(tags)},
    )  # fmt: skip
    sample = RolloutSample(full_batch=full, sample_id="all", epoch=0, rollout_status={})
    assembled = assemble_batch_from_rollout_samples([sample], None, config)
    meta = assembled.meta_info
    found = {k: float(v) for k, v in meta.items() if k.startswith("fully_async/partial/")}
    found["param_version_diversity"] = int(meta["param_version_diversity"])
    found["trajectory_param_versions"] = [int(v) for v in meta["trajectory_param_versions"]]
    return found


def run(manager: Any, server: Any, config: Any, vllm_url: str, work: Path, mode: str) -> None:
    uids = schedule(manager, server, vllm_url)
    keys, tags, data = rollouts(uids)
    result = {
        "uids": [key.rsplit("_", 2)[0] for key in keys],
        "batches": [key[0] for key in keys],
        "prompts": [t.tolist() for t in data["prompts"].unbind(0)],
        "responses": [t.tolist() for t in data["responses"].unbind(0)],
        "response_mask": [t.tolist() for t in data["response_mask"].unbind(0)],
        "rollout_log_probs": [t.tolist() for t in data["rollout_log_probs"].unbind(0)],
        "min_global_steps": [int(t["min_global_steps"]) for t in tags],
        "max_global_steps": [int(t["max_global_steps"]) for t in tags],
        "v1_metrics": v1_metrics(config, keys, tags),
        "partial_stats": partial_stats(config, data, tags),
    }
    (work / f"partial-{mode}.json").write_text(json.dumps(result))


def rollout_config(config: Any) -> dict[str, Any]:
    rollout: dict[str, Any] = OmegaConf.to_container(config.actor_rollout_ref.rollout, resolve=True)  # type: ignore[assignment]
    return rollout
