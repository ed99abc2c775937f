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

writes WORK_DIR/batches-<mode>.json for mode `verl` (verl's manager) and `plugin` (verl's
manager through trace-proxy), and the plugin's proxy writes its store to WORK_DIR/traces.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

PROMPTS = ["Say hi", "Count to three", "Name a colour"]
TOOL_PROMPT = "How many words are in 'one two three'? Use the word_count tool."
STEPS = (1, 2)
N = 2


def compose_config(model_dir: str, work: Path, plugin: bool) -> Any:
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
        "trainer.experiment_name=cpu-agent-loop",
        "trainer.use_v1=false",
        f"reward.custom_reward_function.path={Path(__file__).with_name('reward.py')}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
    ]
    if plugin:
        overrides += [
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
            "trace_proxy.integrations.verl.AgentLoopManager",
            f"+trace_proxy.output={work / 'traces'}",
            "+trace_proxy.token2text=true",
        ]
    config_dir = os.path.dirname(verl_config.__file__)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
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


def run(mode: str, vllm_url: str, model_dir: str, work: Path, reward_workers: Any) -> None:
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle
    from verl_harness.server import CpuVllmServer

    plugin = mode == "plugin"
    config = compose_config(model_dir, work, plugin)
    rollout = OmegaConf.to_container(config.actor_rollout_ref.rollout, resolve=True)
    address = vllm_url.removeprefix("http://")
    server = CpuVllmServer.remote(vllm_url, rollout)
    balancer = get_router_handle(servers={address: server}, router_config_path=None,
                                 full_determinism=False, load_balancer_cls=None)  # fmt: skip
    client = LLMServerClient(config=config, load_balancer_handle=balancer)
    fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
    if fqn:
        manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")
    else:
        from verl.experimental.agent_loop import AgentLoopManager as manager_cls
    manager = manager_cls.create(
        config=config,
        llm_client=client,
        teacher_client=None,
        reward_loop_worker_handles=reward_workers,
    )
    results: dict[str, Any] = {}
    for step in STEPS:
        ray.get(server.set_global_steps.remote(step))
        results[f"step{step}"] = as_json(manager.generate_sequences(batch(step, False)))
    results["validate"] = as_json(manager.generate_sequences(batch(STEPS[-1], True)))
    results["server_calls"] = ray.get(server.__ray_call__.remote(lambda s: s.calls))
    (work / f"batches-{mode}.json").write_text(json.dumps(results))
    launched = getattr(manager, "_trace_proxy", None)
    if launched is not None:
        launched.stop()  # drains: every record is in the store when this returns
    for actor in manager.agent_loop_workers:
        ray.kill(actor)


def main() -> int:
    vllm_url, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["verl", "plugin"]
    paths = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": paths})
    from verl.experimental.reward_loop import RewardLoopManager

    rewards = RewardLoopManager(compose_config(model_dir, work, False), rm_resource_pool=None)
    for mode in modes:
        run(mode, vllm_url, model_dir, work, rewards.reward_loop_worker_handles)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
