"""What the verl plugin adds to each generate call: the HTTP hop through trace-proxy instead of
verl's Ray call to its server actor.

Runs in a verl venv (verl 0.9.1, Ray) with this checkout on PYTHONPATH:

    PYTHONPATH=. VERL_PYTHON benchmarks/verl_hop.py [--calls 2048] [--concurrency 1,64,256]
        [--rounds 3]

Both paths use verl's real LLM client and load balancer (`LLMServerClient`,
`get_router_handle`), against one server actor that answers at once, so what is measured is
the client-side path alone: verl's own (acquire, Ray call to the actor's `generate`, release)
and the plugin's (acquire, HTTP POST through the node's trace-proxy, started by the plugin's
own `ProxyFleet` as a Ray actor, recording every call to jsonl, to the same actor's HTTP port;
`global_steps` and the gate read from the server actor for each call (calls arriving together
share a read that starts after each arrived); release). The upstream
answers /v1/completions with a fixed body of 16 token ids and log probs; the actor's
`generate` returns the same tokens as verl's TokenOutput. As on a GPU node, the proxy (and
its helper processes) has a core of its own (`--pin`, the default): everything else, this
process and Ray's, runs on core 0, the proxy on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from aiohttp import web

OUTPUT_IDS = list(range(1000, 1016))
PROMPT = list(range(200, 712))  # 512 prompt ids
BODY = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": "x" * 16, "finish_reason": "length", "stop_reason": None,
                     "token_ids": OUTPUT_IDS, "prompt_token_ids": None,
                     "logprobs": {"token_logprobs": [-0.5] * 16, "tokens": ["x"] * 16,
                                  "text_offset": list(range(16)), "top_logprobs": None}}],
        "usage": {"prompt_tokens": 512, "completion_tokens": 16, "total_tokens": 528}}  # fmt: skip


@ray.remote
class InstantServer:
    """verl's server actor interface, answering at once (Ray) and over HTTP (its address)."""

    def __init__(self) -> None:
        self.global_steps = 1

    async def start(self) -> str:
        app = web.Application()

        async def completions(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(BODY)

        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"127.0.0.1:{port}"

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       request_id: str, **kwargs: Any) -> Any:  # fmt: skip
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(token_ids=OUTPUT_IDS, log_probs=[-0.5] * 16, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})  # fmt: skip


async def timed(client: Any, calls: int, concurrency: int) -> list[float]:
    from trace_proxy.integrations.verl.context import CURRENT_RUN, RunState
    from trace_proxy.integrations.verl.link import TrajectoryTags

    latencies: list[float] = []
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                "logprobs": True}  # fmt: skip

    async def worker(index: int) -> None:
        for turn in range(calls // concurrency):
            tags = TrajectoryTags("bench", "hop", 1, index, 0, False, f"t{index}-{turn}")
            CURRENT_RUN.set(RunState(tags))
            started = time.perf_counter()
            await client.generate(f"r{index}-{turn}", prompt_ids=PROMPT,
                                  sampling_params=dict(sampling))  # fmt: skip
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies


def summary(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.99) - 1] * 1e3


async def measure(paths: dict[str, Any], calls: int, concurrencies: list[int],
                  rounds: int) -> None:  # fmt: skip
    """Each concurrency in `rounds` rounds, the paths' order alternating between rounds, so that
    a drift of the machine (Ray's own calls vary by milliseconds) falls on both paths alike."""
    names = list(paths)
    for concurrency in concurrencies:
        added: list[tuple[float, float]] = []
        for round_ in range(rounds):
            results = {}
            for name in names if round_ % 2 == 0 else names[::-1]:
                await timed(paths[name], 40, concurrency)  # warm-up: connections, Ray's calls
                results[name] = summary(await timed(paths[name], calls, concurrency))
                p50, p99 = results[name]
                print(f"| {concurrency} | {round_ + 1} | {name} | {p50:.2f} | {p99:.2f} |",
                      flush=True)  # fmt: skip
            (own_p50, own_p99), (hop_p50, hop_p99) = (results[name] for name in names)
            added.append((hop_p50 - own_p50, hop_p99 - own_p99))
            print(f"| {concurrency} | {round_ + 1} | added by the plugin | "
                  f"{hop_p50 - own_p50:+.2f} | {hop_p99 - own_p99:+.2f} |", flush=True)  # fmt: skip
        p50 = statistics.median(p50 for p50, _ in added)
        p99 = statistics.median(p99 for _, p99 in added)
        print(f"| {concurrency} | median of {rounds} | added by the plugin | {p50:+.2f} | "
              f"{p99:+.2f} |", flush=True)  # fmt: skip
    for client in paths.values():
        link = getattr(client, "_trace_proxy_link", None)
        if link is not None and link._session is not None:
            await link._session.close()


def pin_tree(pid: int, core: int) -> list[int]:
    """`pid` and every process below it, each thread, onto `core`; returns the pids."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            children = (task / "children").read_text().split()
            pending += [int(child) for child in children]
        for task in Path(f"/proc/{current}/task").iterdir():
            os.sched_setaffinity(int(task.name), {core})
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2048)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per concurrency, the paths' order alternating")  # fmt: skip
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="the proxy on core 1, everything else on core 0")  # fmt: skip
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})  # Ray's processes, started from here, inherit it
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from trace_proxy.integrations.verl.fleet import ProxyFleet
    from trace_proxy.integrations.verl.link import ProxyLink
    from trace_proxy.integrations.verl.mapping import ServerLimits
    from trace_proxy.integrations.verl.transport import install

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    server = InstantServer.remote()
    address = ray.get(server.start.remote())
    config = OmegaConf.create({"actor_rollout_ref": {
        "rollout": {"name": "vllm", "full_determinism": False, "disaggregation": {"enabled": False},
                    "enable_rollout_routing_replay": False},
        "model": {"lora_rank": 0}}})  # fmt: skip
    balancer = get_router_handle(servers={address: server}, router_config_path=None,
                                 full_determinism=False, load_balancer_cls=None)  # fmt: skip
    own = LLMServerClient(config=config, load_balancer_handle=balancer)
    with tempfile.TemporaryDirectory() as store:
        traced = LLMServerClient(config=config, load_balancer_handle=balancer)
        fleet = ProxyFleet.start(traced, [], store, timeout=300)
        [actor] = fleet.actors.values()
        if args.pin:
            pinned = pin_tree(ray.get(actor.status.remote())["pid"], 1)
            print(f"proxy processes {pinned} on core 1; the rest on core 0", flush=True)
        limits = ServerLimits("vllm", 1024, 16, 4096)
        install(traced, ProxyLink(None, None, fleet.admin_token, limits, routes=fleet.routes))
        print("| in flight | round | path | p50 ms | p99 ms |\n|---|---|---|---|---|")
        paths = {"verl (Ray call)": own, "plugin (HTTP via trace-proxy)": traced}
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        asyncio.run(measure(paths, args.calls, concurrencies, args.rounds))
        assert not traced._trace_proxy_link.fallbacks, traced._trace_proxy_link.fallbacks
        fleet.stop()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
