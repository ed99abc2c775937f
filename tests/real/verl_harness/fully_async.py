"""Drive verl 0.9.1's fully asynchronous rollouter as its `fully_async_main` drives it, traced by
the override alone, and once more without it.

    python -m verl_harness.fully_async VLLM_URL MODEL_DIR WORK_DIR

The driver does what `FullyAsyncTaskRunner` does to the rollouter: verl's config composed
from its `fully_async_ppo_trainer.yaml` with command-line style overrides (the plugin's
`agent_loop_manager_class` override among them, nothing else of the plugin),
`FullyAsyncRollouter.remote(...)`, `init_workers`, `set_max_required_samples`, verl's
`MessageQueue` and its client, `load_checkpoint`, the trainer's first weight sync, `fit`.
A full trainer needs GPUs (FSDP); its part is played as `FullyAsyncTrainer` plays it toward
the rollouter: take `required_samples` samples from the queue, then sync the weights
(`set_global_steps(version)` on each server, then `reset_staleness`), until the rollouter
sends its end. verl's server actors are the stand-ins of cpu_replica.py / server.py, in front
of the real vLLM CPU server. trace-proxy is made visible to verl as `pip install` makes it:
a distribution's metadata with the `verl.plugins` entry point pyproject.toml declares.

Writes WORK_DIR/fully-async.json: each rollout the trainer got (uid, index, the versions verl
recorded for it, the version it was trained after) and what `FullyAsyncAgentLoopManager.create`
returns in this process without the override; the proxy writes its store to WORK_DIR/traces.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from typing import Any

from verl_harness import PLUGIN_MANAGER, reward

PROMPTS = ["Say hi", "Count to three", "Name a colour", "Say bye", "Name a fruit", "Say yes"]
N = 2
REQUIRED_SAMPLES = 2  # ppo_mini_batch_size x require_batches
REPO = Path(__file__).resolve().parents[3]


def install_entry_points(site: Path) -> None:
    """The metadata `pip install trace-proxy` writes, for entry points: pyproject's own."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"trace_proxy-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: trace-proxy\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def write_data(work: Path) -> Path:
    import pandas as pd

    rows = [{"prompt": [{"role": "user", "content": text}], "data_source": "cpu-test",
             "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
            for i, text in enumerate(PROMPTS)]  # fmt: skip
    path = work / "prompts.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def compose_config(model_dir: str, work: Path, data: Path, plugin: bool) -> Any:
    from hydra import compose, initialize_config_dir
    from verl.experimental.fully_async_policy import fully_async_main

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.prompt_length=256",
        "actor_rollout_ref.rollout.response_length=12",
        "actor_rollout_ref.rollout.max_model_len=1024",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={REQUIRED_SAMPLES}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=0",
        "data.gen_batch_size=1",
        "data.max_prompt_length=256",
        "data.max_response_length=12",
        "data.return_raw_chat=True",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
        f"rollout.total_rollout_steps={len(PROMPTS)}",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.require_batches=1",
        "async_training.staleness_threshold=1",
        "trainer.project_name=verl-plugin-test",
        "trainer.experiment_name=cpu-fully-async",
        "trainer.total_epochs=1",
        "trainer.resume_mode=disable",
        "trainer.device=cpu",
        *reward.OVERRIDES,
    ]
    if plugin:
        overrides += [
            PLUGIN_MANAGER,
            f"+trace_proxy.output={work / 'traces'}",
            "+trace_proxy.max_samples_per_step=2",
        ]
    config_dir = str(Path(fully_async_main.__file__).with_name("config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="fully_async_ppo_trainer", overrides=overrides)
    # as fully_async_main.main does before its task runner starts
    config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
    config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    return config


def dataset_index(uid: str) -> int:
    """The dataset row of verl's sample id `uid_sample_{epoch}_{k}`: the rollouter numbers the
    samples it feeds from 1, in the dataloader's order (not shuffled here); its output batch
    has no `index` column (the agent-loop worker returns a batch of its own)."""
    return int(uid.rsplit("_", 1)[1]) - 1


def sync_weights(servers: list[Any], rollouter: Any, version: int) -> None:
    """The trainer's `_fit_update_weights`, as the rollouter and its servers see it
    (`CheckpointEngineManager.update_weights`): every generation in flight aborted and the
    gate closed, the new version set, generation resumed; then the rollouter's
    `reset_staleness`. verl's client resumes the aborted ones (partial rollout)."""
    import ray

    ray.get([server.abort_all_requests.remote() for server in servers])
    ray.get([server.set_global_steps.remote(version) for server in servers])
    ray.get([server.resume_generation.remote() for server in servers])
    ray.get(rollouter.reset_staleness.remote())


def train(config: Any, tokenizer: Any) -> dict[str, Any]:
    """FullyAsyncTaskRunner's steps toward the rollouter, and the trainer's part."""
    import ray
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
    from verl.experimental.fully_async_policy.message_queue import (
        MessageQueue,
        MessageQueueClient,
    )

    rollouter = FullyAsyncRollouter.remote(config=config, tokenizer=tokenizer, processor=None,
                                           device_name="cpu")  # fmt: skip
    ray.get(rollouter.init_workers.remote())
    ray.get(rollouter.set_max_required_samples.remote())
    queue = MessageQueue.remote(config, ray.get(rollouter.get_max_queue_size.remote()))
    client = MessageQueueClient(queue)
    ray.get(rollouter.set_message_queue_client.remote(client))
    ray.get(rollouter.load_checkpoint.remote())
    servers = [replica._server_handle for replica in ray.get(rollouter.get_replicas.remote())]
    version = 0
    sync_weights(servers, rollouter, version)
    done = rollouter.fit.remote()
    samples: list[dict[str, Any]] = []
    taken = 0
    while True:
        sample, _ = client.get_sample_sync()  # (sample, queue length), as the trainer reads
        if sample is None:  # the rollouter's end
            break
        rollout = ray.cloudpickle.loads(sample)
        rows = rollout.full_batch.non_tensor_batch
        for row in range(len(rollout.full_batch)):
            uid = str(rows["uid"][row])
            samples.append({"uid": uid, "index": dataset_index(uid),
                            "min": int(rows["min_global_steps"][row]),
                            "max": int(rows["max_global_steps"][row]),
                            "trained_after": version})  # fmt: skip
        taken += 1
        if taken % REQUIRED_SAMPLES == 0:
            version += 1
            sync_weights(servers, rollouter, version)
    ray.get(done)
    return {"samples": samples, "versions": version}


def _client(config: Any) -> tuple[Any, Any]:
    """verl's fully async client over a stand-in server and verl's load balancer."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
    from verl.workers.rollout.router import get_router_handle
    from verl_harness.server import CpuVllmServer

    url = os.environ["TRACE_PROXY_TEST_VLLM_URL"]
    rollout = OmegaConf.to_container(config.actor_rollout_ref.rollout, resolve=True)
    server = CpuVllmServer.remote(url, rollout)
    balancer = get_router_handle(servers={url.removeprefix("http://"): server},
                                 router_config_path=None, full_determinism=False,
                                 load_balancer_cls=None)  # fmt: skip
    return FullyAsyncLLMServerClient(config=config, load_balancer_handle=balancer), server


def honoured_key(config: Any) -> list[str]:
    """A verl whose rollouter honours `agent_loop_manager_class` (verl PR #6565) would await
    `load_class_from_fqn(key).create(...)` in its coroutine: the classes of what it gets."""
    import asyncio

    import ray
    from verl.utils.import_utils import load_class_from_fqn

    llm_client, server = _client(config)
    fqn = config.actor_rollout_ref.rollout.agent.agent_loop_manager_class

    async def init_async_rollout_manager() -> Any:
        return await load_class_from_fqn(fqn, "AgentLoopManager").create(
            config=config, llm_client=llm_client, reward_loop_worker_handles=None,
            teacher_client=None)  # fmt: skip

    manager = asyncio.run(init_async_rollout_manager())
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(manager).__mro__]
    manager._trace_proxy.stop()
    ray.kill(server)
    return classes


def untouched(config: Any) -> dict[str, Any]:
    """What the rollouter's name builds without the override: verl's own manager and client."""
    import ray
    from verl.experimental.fully_async_policy import fully_async_rollouter as module
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    llm_client, server = _client(config)
    manager = module.FullyAsyncAgentLoopManager.create(config=config, llm_client=llm_client)
    stand_in = module.FullyAsyncAgentLoopManager
    verl_class = stand_in.__dict__.get("_trace_proxy_verl_class")
    found = {
        "hooked": verl_class is not None,
        "manager_is_verls": verl_class is not None and type(manager) is verl_class,
        "client_is_verls": type(llm_client) is FullyAsyncLLMServerClient,
        "workers_are_verls": manager.agent_loop_workers_class.__ray_actor_class__.__name__,
    }
    ray.kill(server)
    return found


def main() -> int:
    vllm_url, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    site = work / "site"
    install_entry_points(site)
    sys.path.append(str(site))
    paths = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(site)])
    env = {"PYTHONPATH": paths, "VERL_USE_EXTERNAL_MODULES": "verl_harness.cpu_replica",
           "TRACE_PROXY_TEST_VLLM_URL": vllm_url,
           # Ray's memory monitor kills workers when the host is 95% full, however little they
           # use: on a shared test machine that is other processes' memory, not this run's
           "RAY_memory_monitor_refresh_ms": "0"}  # fmt: skip
    os.environ.update(env)
    import ray
    from verl.utils import hf_tokenizer

    # a cluster of its own ("local"), never one another process on this machine started
    ray.init(address="local", num_cpus=16, include_dashboard=False,
             runtime_env={"env_vars": env})  # fmt: skip
    data = write_data(work)
    tokenizer = hf_tokenizer(model_dir)
    results = train(compose_config(model_dir, work, data, plugin=True), tokenizer)
    results["untouched"] = untouched(compose_config(model_dir, work, data, plugin=False))
    results["honoured_key"] = honoured_key(compose_config(model_dir, work, data, plugin=True))
    (work / "fully-async.json").write_text(json.dumps(results))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
