"""Drive verl 0.9.1's agent-loop manager as its trainer does, with and without the plugin.

A full `main_ppo` needs GPUs (FSDP actor, vLLM engine inside verl's server actors), so this
drives the part the plugin changes exactly as verl's trainer does: verl's config composed from
its own `ppo_trainer.yaml` with command-line style overrides, verl's real reward-loop manager
(a custom reward function), verl's real load balancer (`get_router_handle`) and LLM client
(`LLMServerClient`), and the manager class loaded with verl's `load_class_from_fqn` from
`actor_rollout_ref.rollout.agent.agent_loop_manager_class`, created with `.create(config=...,
llm_client=..., teacher_client=None, reward_loop_worker_handles=...)` and called with
`generate_sequences` on batches shaped as the legacy trainer shapes them (n interleaved
copies, `index`, `global_steps` and `validate` in meta_info). Only verl's server actor is a
stand-in (server.py), in front of the real vLLM CPU server.

    python -m verl_harness.run VLLM_URL MODEL_DIR WORK_DIR

writes WORK_DIR/batches-<mode>.json for modes `verl` and `v1-verl` (verl's legacy and v1
managers) and `plugin` and `v1-plugin` (the same through the plugin: the first starts its
trace-proxy, the second uses that one by URL, as a sidecar), `async-verl` and `async-plugin`
(v1's asynchronous trainers' manager and `FullyAsyncLLMServerClient` across weight syncs that
abort generations in flight: partial.py, writing WORK_DIR/partial-<mode>.json),
`offpolicy-verl` and `offpolicy-plugin` (the one-step-off-policy trainer's rollout across its
weight syncs: offpolicy.py, writing WORK_DIR/offpolicy-<mode>.json), and the proxy writes its
store to WORK_DIR/traces (experiments `cpu-agent-loop`, `cpu-agent-loop-v1`,
`cpu-partial-rollout` and `cpu-one-step-off`). Each phase's seconds go to the run's log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl_harness import PLUGIN_MANAGER, reward

PROMPTS = ["Say hi", "Count to three", "Name a colour"]
TOOL_PROMPT = "How many words are in 'one two three'? Use the word_count tool."
STEPS = (1, 2)
N = 2


def compose_config(
    model_dir: str,
    work: Path,
    plugin: bool,
    v1: bool = False,
    sidecar: Any = None,
    extra: Sequence[str] = (),
    one_step_off: bool = False,
) -> Any:
    """verl's config as its `main_ppo` composes it from `ppo_trainer.yaml` and command-line
    overrides (`one_step_off`: as the one-step-off-policy trainer's main composes it, from its
    `one_step_off_ppo_trainer.yaml`, which builds on `ppo_trainer.yaml`); with the plugin,
    only the overrides its documentation names (and `extra`)."""
    import verl.trainer.config as verl_config

    tool_config = work / "tools.yaml"
    from verl_harness.tools import TOOL_CONFIG

    tool_config.write_text(TOOL_CONFIG)
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.prompt_length=512",
        "actor_rollout_ref.rollout.response_length=48",
        "actor_rollout_ref.rollout.max_model_len=2048",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
        "trainer.project_name=verl-plugin-test",
        f"trainer.experiment_name=cpu-agent-loop{'-v1' if v1 else ''}",
        f"trainer.use_v1={'true' if v1 else 'false'}",
        "transfer_queue.enable=true",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *reward.OVERRIDES,
    ]
    if plugin:
        overrides += [PLUGIN_MANAGER]
        if sidecar is None:
            overrides += [f"+trace_proxy.output={work / 'traces'}"]
        else:
            os.environ["TRACE_PROXY_ADMIN_TOKEN"] = sidecar.admin_token
            overrides += [f"+trace_proxy.url={sidecar.proxy_url}",
                          f"+trace_proxy.admin_url={sidecar.admin_url}"]  # fmt: skip
    replaced = {item.split("=", 1)[0] for item in extra}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in replaced] + list(extra)
    config_dir = os.path.dirname(verl_config.__file__)
    config_name = "ppo_trainer"
    if one_step_off:  # its yaml finds ppo_trainer.yaml relative to verl's source tree
        import verl.experimental.one_step_off_policy as one_step_off_policy

        overrides.append(f"hydra.searchpath=[file://{config_dir}]")
        config_dir = os.path.join(os.path.dirname(one_step_off_policy.__file__), "config")
        config_name = "one_step_off_ppo_trainer"
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name=config_name, overrides=overrides)
    return config


def batch(step: int, validate: bool) -> Any:
    """What the legacy trainer hands the manager: n interleaved copies of each prompt."""
    from verl import DataProto

    rows: list[dict[str, Any]] = []
    for index, text in enumerate(PROMPTS):
        rows.append({"raw_prompt": [{"role": "user", "content": text}],
                     "agent_name": "single_turn_agent", "index": index})  # fmt: skip
    rows.append({"raw_prompt": [{"role": "user", "content": TOOL_PROMPT}],
                 "agent_name": "tool_agent", "index": len(PROMPTS)})  # fmt: skip
    n = 1 if validate else N
    repeated = [row for row in rows for _ in range(n)]
    non_tensor = {
        "raw_prompt": np.array([r["raw_prompt"] for r in repeated], dtype=object),
        "agent_name": np.array([r["agent_name"] for r in repeated], dtype=object),
        "index": np.array([r["index"] for r in repeated], dtype=object),
        "data_source": np.array(["cpu-test"] * len(repeated), dtype=object),
        "reward_model": np.array([{"ground_truth": "x"}] * len(repeated), dtype=object),
        "extra_info": np.array([{"index": r["index"]} for r in repeated], dtype=object),
        "tools_kwargs": np.array([{} for _ in repeated], dtype=object),
    }
    proto = DataProto.from_dict(
        tensors={"dummy": torch.zeros(len(repeated), 1)},
        non_tensors=non_tensor,
        meta_info={"global_steps": step, "validate": validate},
    )
    return proto


def v1_batch(step: int, validate: bool) -> tuple[Any, list[str]]:
    """What verl's v1 trainer hands its manager: one row per prompt, `uid`s registered in
    TransferQueue as pending prompts, `global_steps` and `validate` as non-tensor data."""
    import uuid

    import transfer_queue as tq
    from verl.utils import tensordict_utils as tu

    texts = [*PROMPTS, TOOL_PROMPT]
    agents = ["single_turn_agent"] * len(PROMPTS) + ["tool_agent"]
    uids = [str(uuid.uuid4()) for _ in texts]
    batch_dict = {
        "raw_prompt": np.array([[{"role": "user", "content": t}] for t in texts], dtype=object),
        "agent_name": np.array(agents, dtype=object),
        "index": np.array(list(range(len(texts))), dtype=object),
        "data_source": np.array(["cpu-test"] * len(texts), dtype=object),
        "reward_model": np.array([{"ground_truth": "x"}] * len(texts), dtype=object),
        "extra_info": np.array([{"index": i} for i in range(len(texts))], dtype=object),
        "tools_kwargs": np.array([{} for _ in texts], dtype=object),
        "uid": np.array(uids, dtype=object),
    }
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    tu.assign_non_tensor_data(batch, "validate", validate)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="val" if validate else "train", tags=tags)
    return batch, uids


def v1_results(uids: list[str], validate: bool) -> dict[str, Any]:
    """Wait for every prompt's sessions to finish, as verl's replay buffer does, then read
    each session's output from TransferQueue (sample-major, session order)."""
    import transfer_queue as tq

    partition = "val" if validate else "train"
    deadline = time.monotonic() + 600
    while True:
        listing = tq.kv_list(partition).get(partition, {})
        states = [(listing.get(uid) or {}).get("status") for uid in uids]
        if all(state in ("finished", "failure") for state in states):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"v1 sessions still running: {states}")
        time.sleep(0.2)
    assert all(state == "finished" for state in states), states
    n = 1 if validate else N
    keys = [f"{uid}_{session}_0" for uid in uids for session in range(n)]
    fields = ["prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores",
              "num_turns", "extra_fields"]  # fmt: skip
    data = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=fields)
    extra = _values(data["extra_fields"])
    return {
        "prompts": [t.tolist() for t in data["prompts"].unbind(0)],
        "responses": [t.tolist() for t in data["responses"].unbind(0)],
        "response_mask": [t.tolist() for t in data["response_mask"].unbind(0)],
        "rollout_log_probs": [t.tolist() for t in data["rollout_log_probs"].unbind(0)],
        "rm_scores": [float(t.sum()) for t in data["rm_scores"].unbind(0)],
        "num_turns": [int(x) for x in _values(data["num_turns"])],
        "global_steps": [int(e["min_global_steps"]) for e in extra]
        + [int(e["max_global_steps"]) for e in extra],
    }


def _values(stacked: Any) -> list[Any]:
    """A non-tensor field read back from TransferQueue, as a list."""
    return stacked.tolist() if hasattr(stacked, "tolist") else list(stacked)


def as_json(output: Any) -> dict[str, Any]:
    tensors = output.batch
    rows = {
        "responses": tensors["responses"].tolist(),
        "response_mask": tensors["response_mask"].tolist(),
        "attention_mask": tensors["attention_mask"].tolist(),
        "prompts": tensors["prompts"].tolist(),
        "rollout_log_probs": tensors["rollout_log_probs"].tolist(),
        "rm_scores": tensors["rm_scores"].sum(-1).tolist(),
        "num_turns": output.non_tensor_batch["__num_turns__"].tolist(),
        "global_steps": [int(x) for x in output.non_tensor_batch["min_global_steps"]]
        + [int(x) for x in output.non_tensor_batch["max_global_steps"]],
    }
    return rows


@dataclass
class Built:
    mode: str
    manager: Any
    server: Any
    config: Any = None
    balancer: Any = None


@dataclass
class Serving:
    """verl's server actor and its load balancer, as its trainer starts them once: the four
    managers share them (one Ray actor each, not four), and each run counts the calls that
    reached the server while it ran."""

    server: Any
    balancer: Any

    @classmethod
    def start(cls, vllm_url: str, config: Any) -> Serving:
        from verl.workers.rollout.router import get_router_handle
        from verl_harness.server import CpuVllmServer

        rollout = OmegaConf.to_container(config.actor_rollout_ref.rollout, resolve=True)
        server = CpuVllmServer.remote(vllm_url, rollout)
        address = vllm_url.removeprefix("http://")
        balancer = get_router_handle(servers={address: server}, router_config_path=None,
                                     full_determinism=False, load_balancer_cls=None)  # fmt: skip
        return cls(server, balancer)


def build(mode: str, serving: Serving, model_dir: str, work: Path, reward_workers: Any,
          sidecar: Any = None, legacy: Any = None) -> Built:  # fmt: skip
    """One manager as verl's trainer builds it. `sidecar`: a running proxy (the one the first
    plugin manager started) that this one uses by URL instead of starting its own. `async-`
    modes: v1's asynchronous trainers' manager and client (partial.py); `offpolicy-` modes:
    the one-step-off-policy trainer, its manager built by its own method (offpolicy.py;
    `legacy`: the `verl` mode's manager, what that method builds without the plugin)."""
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
    from verl_harness import offpolicy, partial

    plugin = mode.endswith("plugin")
    if mode.startswith("offpolicy"):
        config = compose_config(model_dir, work, plugin, True, sidecar, offpolicy.overrides(),
                                one_step_off=True)  # fmt: skip
        trainer = offpolicy.trainer(config, serving.server, serving.balancer, reward_workers,
                                    None if plugin else legacy)  # fmt: skip
        return Built(mode, trainer, serving.server, config)
    asynchronous = mode.startswith("async")
    v1 = mode.startswith("v1") or asynchronous
    extra = partial.overrides() if asynchronous else ()
    config = compose_config(model_dir, work, plugin, v1, sidecar, extra)
    client_cls = FullyAsyncLLMServerClient if asynchronous else LLMServerClient  # get_llm_client
    client = client_cls(config=config, load_balancer_handle=serving.balancer)
    fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
    if fqn:  # as verl's trainers do: main_ppo.py (v1), ray_trainer.py (legacy)
        manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")
    elif v1:
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ as manager_cls
    else:
        from verl.experimental.agent_loop import AgentLoopManager as manager_cls
    manager = manager_cls.create(
        config=config,
        llm_client=client,
        teacher_client=None,
        reward_loop_worker_handles=reward_workers,
    )
    return Built(mode, manager, serving.server, config, serving.balancer)


def _server_calls(server: Any) -> int:
    calls: int = ray.get(server.__ray_call__.remote(lambda s: s.calls))
    return calls


def run(built: Built, work: Path, vllm_url: str) -> None:
    """Two training steps and a validation pass, as the trainer hands them to the manager;
    `async-` modes: the schedule of weight syncs in partial.py; `offpolicy-` modes: the
    one-step-off-policy trainer's steps (offpolicy.py)."""
    manager, server, v1 = built.manager, built.server, built.mode.startswith("v1")
    if built.mode.startswith("offpolicy"):
        from verl_harness import offpolicy

        offpolicy.run(manager, server, work, built.mode)
        return
    if built.mode.startswith("async"):
        from verl_harness import partial

        partial.run(manager, server, built.config, vllm_url, work, built.mode)
        return
    results: dict[str, Any] = {}
    calls_before = _server_calls(server)
    for step in STEPS:
        ray.get(server.set_global_steps.remote(step))
        if v1:
            rows, uids = v1_batch(step, False)
            manager.generate_sequences(rows)
            results[f"step{step}"] = v1_results(uids, False)
        else:
            results[f"step{step}"] = as_json(manager.generate_sequences(batch(step, False)))
    if v1:
        rows, uids = v1_batch(STEPS[-1], True)
        manager.generate_sequences(rows)
        results["validate"] = v1_results(uids, True)
    else:
        results["validate"] = as_json(manager.generate_sequences(batch(STEPS[-1], True)))
    results["server_calls"] = _server_calls(server) - calls_before  # this run's alone
    (work / f"batches-{built.mode}.json").write_text(json.dumps(results))


def main() -> int:
    began = time.monotonic()  # each phase's seconds go to the run's log
    vllm_url, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    default = ["verl", "plugin", "v1-verl", "v1-plugin", "async-verl", "async-plugin",
               "offpolicy-verl", "offpolicy-plugin"]  # fmt: skip
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else default
    paths = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": paths})
    from verl.experimental.reward_loop import RewardLoopManager

    config = compose_config(model_dir, work, False)
    rewards = RewardLoopManager(config, rm_resource_pool=None)
    if any(mode.startswith(("v1", "async")) for mode in modes):
        import transfer_queue as tq

        tq.init(config.transfer_queue)
    # Every manager first, so that their workers start at once; the second plugin manager
    # uses the proxy the first one started, by URL, as a sidecar is used.
    serving = Serving.start(vllm_url, config)
    async_serving = None  # its own server actor: the rollout config differs (partial.py)
    built: list[Built] = []
    started = None
    for mode in modes:
        if mode.startswith("async") and async_serving is None:
            from verl_harness import partial

            async_config = compose_config(model_dir, work, False, True, None, partial.overrides())
            async_serving = Serving.start(vllm_url, async_config)
        each = async_serving if mode.startswith("async") else serving
        assert each is not None
        building = time.monotonic()
        legacy = next((b.manager for b in built if b.mode == "verl"), None)
        built.append(build(mode, each, model_dir, work, rewards.reward_loop_worker_handles,
                           started if mode.endswith("plugin") else None, legacy))  # fmt: skip
        print(f"{mode} built: {time.monotonic() - building:.1f} s", flush=True)
        started = started or getattr(built[-1].manager, "_trace_proxy", None)
    print(f"managers built: {time.monotonic() - began:.1f} s", flush=True)
    for each in built:
        ran = time.monotonic()
        run(each, work, vllm_url)
        print(f"{each.mode}: {time.monotonic() - ran:.1f} s", flush=True)
    if started is not None:
        started.stop()  # drains: every record is in the store when this returns
    ray.shutdown()
    print(f"run: {time.monotonic() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
