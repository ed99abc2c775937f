"""verl 0.9.1's one-step-off-policy trainer: each batch generated while it trains on the last.

`experimental/one_step_off_policy/ray_trainer.py` (`OneStepOffRayTrainer`) builds its manager
in `_init_async_rollout_manager` from `agent_loop_manager_class` (verl's legacy
`AgentLoopManager` by default) with the plain `LLMServerClient`. `fit` syncs the weights to
version 0 and starts batch 1; each step's `_fit_generate` waits for its batch, syncs the weights
(`CheckpointEngineManager.update_weights(global_steps)`) and starts the next batch before
training on this one. A batch is tagged with the trainer's step when it starts, so batch 2
carries step 1 like batch 1 but is generated on version 1.

This runs verl's own `_init_async_rollout_manager`, `_async_gen_next_batch` and
`_fit_generate` in `fit`'s order, on a trainer holding only what they read (without the
plugin, the run's legacy manager stands for what the first builds: the same class, client
and load balancer). What needs GPUs is stood in: `LLMServerManager.create` (it launches the
replicas) gives verl's own manager over the stand-in server actor (server.py) and its load
balancer; the checkpoint engine's
`update_weights` is what the server sees of it (abort and close the gate, `set_global_steps`,
resume and open the gate: partial.py's `sync`); the training between syncs is verl's
`compute_data_metrics` over the batch, what `_fit_collect_metrics` logs of it. Three steps,
2 prompts x n=2 per batch:

  sync to 0; batch A (step 1) on version 0
  step 1: A back; sync to 1; batch B (step 1) on 1
  step 2: B back; the sync to 2 is forced to overlap C: the gate closes, C (step 2) is sent,
          and once verl's load balancer counts C's 4 rollouts in flight (each waiting at the
          gate) the version is set to 2 and the gate opens: C on 2
  step 3: C back; sync to 3 (the last step starts no batch)

No sync aborts a generation mid-way here: this trainer's client does not resume (an aborted
rollout keeps the tokens it had, as many as timing gave it), so two runs could not be
compared; partial.py does that with the client that resumes.
Writes WORK/offpolicy-<mode>.json: each row's batch, uid, tokens, masks, log probs, reward and
min/max version, verl's metrics of each batch, and the calls that reached the server actor.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import torch
from verl_harness import partial

EXPERIMENT = "cpu-one-step-off"
PROMPTS = {"A": ["Say hi", "Count to three"], "B": ["Name a colour", "Spell cat"],
           "C": ["Say bye", "Name a fruit"]}  # fmt: skip
STEPS = 3
FORCED_SYNC = 2  # the version whose sync overlaps the next batch's start
POLL_S = 0.01
WAIT_S = 300.0


def overrides() -> list[str]:
    """On top of `one_step_off_ppo_trainer.yaml`: no actor workers here to balance over."""
    return [f"trainer.experiment_name={EXPERIMENT}", "trainer.balance_batch=false"]


class ServersStandIn:
    """`LLMServerManager` as the trainer uses it: `create` would launch the GPU replicas; this
    gives verl's own manager with the stand-in server's load balancer (its `get_client`)."""

    def __init__(self, balancer: Any) -> None:
        self.balancer = balancer

    def create(self, config: Any) -> Any:
        from verl.workers.rollout.llm_server import LLMServerManager

        servers = LLMServerManager.__new__(LLMServerManager)
        servers.config = config
        servers.global_load_balancer = self.balancer
        return servers


class CheckpointStandIn:
    """`CheckpointEngineManager.update_weights` as the server sees it; the forced sync only
    closes the gate, and `finish_forced` sets its version and opens the gate."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.pending: int | None = None

    def update_weights(self, global_steps: int) -> dict[str, Any]:
        if global_steps == FORCED_SYNC:
            partial.close_gate(self.server)
            self.pending = global_steps
        else:
            partial.sync(self.server, global_steps)
        return {}

    async def finish_forced(self, balancer: Any, rollouts: int) -> None:
        """Once the next batch's rollouts are all in flight (waiting at the gate)."""
        assert self.pending is not None
        deadline = time.monotonic() + WAIT_S
        while (inflight := await balancer.get_total_inflight.remote()) != rollouts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{inflight} rollouts in flight, not {rollouts}")
            await asyncio.sleep(POLL_S)
        partial.open_gate(self.server, self.pending)
        self.pending = None


@contextmanager
def servers_stand_in(balancer: Any) -> Iterator[None]:
    from verl.experimental.one_step_off_policy import ray_trainer

    verls = ray_trainer.LLMServerManager
    ray_trainer.LLMServerManager = ServersStandIn(balancer)  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        ray_trainer.LLMServerManager = verls  # type: ignore[misc]


def trainer(
    config: Any, server: Any, balancer: Any, reward_workers: Any, legacy: Any = None
) -> Any:
    """The trainer as `init_workers` leaves it, its manager built by verl's own method.
    `legacy`: verl's legacy manager over the same client and load balancer, already built
    (run.py's `verl` mode), which is what that method builds without the plugin: used as it
    is, its workers are not started twice."""
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

    built = OneStepOffRayTrainer.__new__(OneStepOffRayTrainer)
    built.config = config
    built.use_rm = False
    built.reward_loop_manager = SimpleNamespace(reward_loop_workers=reward_workers)
    built.actor_rollout_wg = None
    built.total_training_steps = STEPS
    built.global_steps = 0
    built.is_last_step = False
    built.metrics, built.timing_raw = {}, {}
    if legacy is None:
        with servers_stand_in(balancer):
            built._init_async_rollout_manager()
    else:
        built.llm_server_manager = ServersStandIn(balancer).create(config)
        built.async_rollout_manager = legacy
    built.checkpoint_manager = CheckpointStandIn(server)
    return built


def batches() -> Iterator[tuple[int, dict[str, Any]]]:
    """The dataloader's batches: rows as verl's `RLHFDataset` gives them, its `collate_fn`."""
    from verl.utils.dataset.rl_dataset import collate_fn

    for offset, name in enumerate(sorted(PROMPTS)):
        rows = []
        for i, text in enumerate(PROMPTS[name]):
            index = offset * len(PROMPTS[name]) + i
            rows.append({"data_source": "cpu-test", "reward_model": {"ground_truth": "x"},
                         "extra_info": {"index": index},
                         "raw_prompt": [{"role": "user", "content": text}],
                         "dummy_tensor": torch.tensor([0], dtype=torch.uint8), "index": index,
                         "tools_kwargs": {}, "interaction_kwargs": {}})  # fmt: skip
        yield 0, collate_fn(rows)


async def fit(built: Any) -> list[Any]:
    """`OneStepOffRayTrainer.fit` and `fit_step` around `_fit_generate`; each step's batch."""
    checkpoint = built.checkpoint_manager
    balancer = built.llm_server_manager.global_load_balancer
    rollouts = len(PROMPTS["C"]) * built.config.actor_rollout_ref.rollout.n
    built.global_steps = 0
    built._fit_update_weights()
    built.global_steps = 1
    iterator = batches()
    future = asyncio.create_task(built._async_gen_next_batch(iterator))
    trained = []
    while future is not None:
        built.metrics = {"training/global_step": built.global_steps, "training/epoch": 0}
        built.timing_raw = {}
        built._fit_prepare_step()
        batch, future = await built._fit_generate(future, iterator)
        if checkpoint.pending is not None:
            await checkpoint.finish_forced(balancer, rollouts)
        trained.append(batch)
        built.global_steps += 1
    return trained


def data_metrics(batch: Any) -> dict[str, float]:
    """verl's `compute_data_metrics`, with the reward step's scores (verl's reward, no KL
    penalty) and the training's advantages and returns as zeros."""
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    scores = batch.batch["rm_scores"]
    batch.batch["token_level_scores"] = scores
    batch.batch["token_level_rewards"] = scores
    zeros = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
    batch.batch["advantages"] = zeros
    batch.batch["returns"] = zeros
    return {k: float(v) for k, v in compute_data_metrics(batch=batch, use_critic=False).items()}


def run(built: Any, server: Any, work: Path, mode: str) -> None:
    from verl_harness.run import as_json

    calls_before = ray.get(server.__ray_call__.remote(lambda s: s.calls))
    trained = asyncio.run(fit(built))
    result: dict[str, Any] = {"batches": [], "uids": [], "metrics": []}
    for name, batch in zip(sorted(PROMPTS), trained, strict=True):
        rows = as_json(batch)
        del rows["global_steps"]  # its oldest, then its newest versions: kept per row below
        for field in ("min_global_steps", "max_global_steps", "global_steps"):
            rows[field] = [int(v) for v in batch.non_tensor_batch[field]]
        for field, values in rows.items():
            result.setdefault(field, []).extend(values)
        result["batches"] += [name] * len(batch)
        result["uids"] += [str(uid) for uid in batch.non_tensor_batch["uid"]]
        result["metrics"].append(data_metrics(batch))
    result["server_calls"] = ray.get(server.__ray_call__.remote(lambda s: s.calls)) - calls_before
    (work / f"offpolicy-{mode}.json").write_text(json.dumps(result))
