"""verl's agent loop traced on a Ray cluster: three nodes on this machine, a rollout server on each.

    python -m verl_harness.cluster MODEL_DIR WORK_DIR

`ray.cluster_utils.Cluster` starts a head and two more nodes, each with its own raylet, node id
and loopback address (127.0.0.1-3; Ray is told to keep every address on loopback). On each node
runs a stand-in for verl's vLLM server actor (server.py's `generate`, as verl 0.9.1 writes it)
in front of the project's simulated vLLM (deterministic, the tiny model's real tokenizer) on
that node's address. verl's real load balancer spreads calls over the three; verl's real
legacy manager, built from verl's config as its trainer builds it (run.py), with agent-loop
workers placed by verl over the nodes, runs the steps twice through the plugin, keeping 2
samples per step:

- `plugin`, writing WORK_DIR/traces-1; in its last step one node's proxy is killed (SIGKILL)
  while calls are in flight, so some of that step's calls take verl's own path; then its
  actors are killed, as Ray kills a job's;
- `rerun`, the same steps, writing WORK_DIR/traces-2, every call through a proxy; then the run
  ends as verl's trainer ends: nothing is stopped, the driver's Ray shuts down and the cluster
  with it (each actor killed, with its children and process group).

(That the plugin's batches equal verl's own path is shown call for call against real vLLM by
run.py; here the two runs' batches are compared, the kill step's included.)

It writes WORK_DIR/cluster.json: each run's batches, which server is on which node, each
proxy's node, replica directory, restarts and process, the workers' fallback counts, and the
`trace-proxy serve` processes still running once the bound within which a proxy drains after
its actor's death has passed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback addresses only

import ray
from omegaconf import OmegaConf
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl_harness.run import as_json, batch, compose_config
from verl_harness.server import VerlServerStandIn

ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
STEPS = (1, 2, 3)
KEEP = 2  # samples per step, across every proxy
KILL_STEP = 3
PROXY_GRACE = 10.0  # each proxy's --shutdown-grace


class SimulatedNodeServer(VerlServerStandIn):
    """verl's server actor on one node, the simulated vLLM behind it on the node's address."""

    def __init__(self, model_dir: str, rollout: dict[str, Any]) -> None:
        super().__init__("", rollout)
        self.model_dir = model_dir
        self.fake: Any = None

    async def start(self) -> str:
        from transformers import AutoTokenizer

        from trace_proxy.demo.simulated_vllm import SimulatedVLLM

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.fake = SimulatedVLLM(tokenizer, model=self.model_dir, deterministic=True)
        _, url = await self.fake.start(host=ray.util.get_node_ip_address())
        self.base_url = url
        return url.removeprefix("http://")

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def slow_down(self, seconds_per_token: float) -> None:
        self.fake.token_delay = seconds_per_token


def start_cluster() -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": ADDRESSES[0], "include_dashboard": False})  # fmt: skip
    for address in ADDRESSES[1:]:
        cluster.add_node(num_cpus=2, node_ip_address=address)
    cluster.wait_for_nodes()
    paths = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address=cluster.address, runtime_env={"env_vars": paths})
    return cluster


def start_servers(model_dir: str, config: Any) -> dict[str, Any]:
    """A server on each node, by its `ip:port`."""
    rollout = OmegaConf.to_container(config.actor_rollout_ref.rollout, resolve=True)
    server_class = ray.remote(SimulatedNodeServer)
    servers = {}
    for node in sorted(ray.nodes(), key=lambda n: n["NodeManagerAddress"]):
        handle = server_class.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(model_dir, rollout)
        servers[ray.get(handle.start.remote())] = handle
    return servers


def build(config: Any, servers: dict[str, Any], rewards: Any) -> Any:
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    balancer = get_router_handle(servers=servers, router_config_path=None,
                                 full_determinism=False, load_balancer_cls=None)  # fmt: skip
    client = LLMServerClient(config=config, load_balancer_handle=balancer)
    fqn = config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
    if fqn:
        manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")
    else:
        from verl.experimental.agent_loop import AgentLoopManager as manager_cls
    return manager_cls.create(config=config, llm_client=client, teacher_client=None,
                              reward_loop_worker_handles=rewards)  # fmt: skip


def cluster_config(model_dir: str, work: Path, traces: str) -> Any:
    config = compose_config(model_dir, work, plugin=True)
    OmegaConf.set_struct(config, False)
    config.actor_rollout_ref.rollout.agent.num_workers = 2  # divides the batch, as verl needs
    config.trainer.experiment_name = "cluster"
    # Token ids only: decoding is run.py's to show, and here each of the six proxies would
    # load the tokenizer twice, which in verl's venv imports torch (seconds and memory each).
    config.trace_proxy = {"output": str(work / traces), "max_samples_per_step": KEEP,
                          "token2text": False,
                          "args": ["--shutdown-grace", str(PROXY_GRACE)]}  # fmt: skip
    return config


def proxy_requests(admin_url: str) -> float:
    """Generate calls the proxy has forwarded so far (its /metrics)."""
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("trace_proxy_requests_total{") and 'kind="generate"' in line
    )  # fmt: skip


def kill_one_proxy_mid_step(manager: Any, servers: dict[str, Any], step: int) -> dict[str, Any]:
    """Run `step` with calls slowed down, and SIGKILL one node's proxy once it has forwarded
    some of them (watched on its /metrics, not timed)."""
    import threading

    fleet = manager._trace_proxy
    node_id, actor = sorted(fleet.actors.items())[-1]
    victim = ray.get(actor.status.remote())
    admin = next(r.admin_url for r in fleet.routes.values() if r.proxy_url == victim["proxy_url"])
    ray.get([server.slow_down.remote(0.02) for server in servers.values()])
    done: dict[str, Any] = {}

    def generate() -> None:
        try:
            done["output"] = manager.generate_sequences(batch(step, False))
        except BaseException as exc:  # a failed training step: what must not happen
            done["error"] = repr(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 300
    while proxy_requests(admin) < 2 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the proxy's count of forwarded calls
    killed_while_running = thread.is_alive()
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join()
    ray.get([server.slow_down.remote(0.0) for server in servers.values()])
    while ray.get(actor.status.remote())["restarts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the actor's word that it started the proxy again
    return {"node_id": node_id, "pid": victim["pid"], "killed_while_running": killed_while_running,
            **done}  # fmt: skip


def worker_fallbacks(manager: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for worker in manager.agent_loop_workers:
        found = ray.get(worker.__ray_call__.remote(
            lambda w: dict(w.llm_client._trace_proxy_link.fallbacks)))  # fmt: skip
        for reason, count in found.items():
            counts[reason] = counts.get(reason, 0) + count
    return counts


def proxies_of(manager: Any) -> list[dict[str, Any]]:
    fleet = manager._trace_proxy
    found = []
    for node_id, actor in fleet.actors.items():
        status = ray.get(actor.status.remote())
        mine = {s: r for s, r in fleet.routes.items() if r.proxy_url == status["proxy_url"]}
        found.append({**status, "node_id": node_id, "servers": sorted(mine),
                      "admin_url": next(iter(mine.values())).admin_url})  # fmt: skip
    return found


def serving_processes(marker: str) -> list[int]:
    """`trace-proxy serve` processes whose command line names `marker` (this run's output)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"trace_proxy" in command
            and b"serve" in command
            and marker.encode() in b" ".join(command)
        ):
            found.append(int(entry.name))
    return found


def restart_one_actor(manager: Any) -> dict[str, Any]:
    """Kill one node's proxy actor and let Ray start it again (as after a crash) while the
    old actor's proxy is still draining (held stopped until the new one answers, as a drain
    on busy cores would be): the new proxy must write elsewhere."""
    _, actor = sorted(manager._trace_proxy.actors.items())[0]
    before = ray.get(actor.status.remote())
    os.kill(before["pid"], signal.SIGSTOP)
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 300
    while True:  # polling until the restarted actor answers (the dead one may answer first)
        try:
            after = ray.get(actor.status.remote(), timeout=30)
            if after["pid"] != before["pid"]:
                break
        except Exception:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.2)
    os.kill(before["pid"], signal.SIGCONT)  # it drains now, and ends
    return {"before": before, "after": after}


def wait_gone(marker: str) -> list[int]:
    """The `trace-proxy serve` processes of this run still running once the bound within
    which a proxy whose actor died must have drained and exited has passed (polled: they
    are nobody's children here)."""
    from trace_proxy.processes.lifeline import ORPHAN_SLACK, orphan_bound

    deadline = time.monotonic() + orphan_bound(PROXY_GRACE) + PROXY_GRACE + ORPHAN_SLACK
    while (running := serving_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def run_steps(manager: Any, servers: dict[str, Any], kill: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for step in STEPS:
        ray.get([server.set_global_steps.remote(step) for server in servers.values()])
        if kill and step == KILL_STEP:
            killed = kill_one_proxy_mid_step(manager, servers, step)
            output = killed.pop("output", None)
            results["killed"] = killed
            results[f"step{step}"] = as_json(output) if output is not None else None
            continue
        results[f"step{step}"] = as_json(manager.generate_sequences(batch(step, False)))
    return results


def main() -> int:
    model_dir, work = sys.argv[1], Path(sys.argv[2])
    started = time.monotonic()
    cluster = start_cluster()
    from verl.experimental.reward_loop import RewardLoopManager

    base = cluster_config(model_dir, work, "traces-1")
    rewards = RewardLoopManager(base, rm_resource_pool=None).reward_loop_worker_handles
    servers = start_servers(model_dir, base)
    nodes = {sid: ray.get(handle.node.remote()) for sid, handle in servers.items()}
    report: dict[str, Any] = {"server_nodes": nodes, "runs": {}}
    for name, traces in (("plugin", "traces-1"), ("rerun", "traces-2")):
        manager = build(cluster_config(model_dir, work, traces), servers, rewards)
        results = run_steps(manager, servers, kill=name == "plugin")
        results["proxies"] = proxies_of(manager)
        results["fallbacks"] = worker_fallbacks(manager)
        report["runs"][name] = results
        if name == "plugin":  # its actors die as a job's do (nothing is stopped); Ray stays
            results["actor_restarted"] = restart_one_actor(manager)
            for actor in [*manager._trace_proxy.actors.values(), *manager.agent_loop_workers]:
                ray.kill(actor)
    # The end of verl's trainer: nothing is stopped; the driver's Ray ends and its cluster
    # with it, every actor killed (their children and process groups with them).
    ray.shutdown()
    cluster.shutdown()
    ended = time.monotonic()
    report["left_running_after_shutdown"] = wait_gone(str(work))
    report["drained_seconds"] = time.monotonic() - ended  # the proxies' drain, after Ray's end
    report["seconds"] = time.monotonic() - started
    (work / "cluster.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
