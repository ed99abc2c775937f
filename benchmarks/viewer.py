"""How fast `trace-proxy ui` opens big stores: indexing, a step of 10,000 trajectories, search.

Builds a store from a real one (the demo's, written by `trace-proxy demo` unless `--from` names
a store): every trajectory of the template store is copied with a new id, key and reward into
one big step (`--step-size`, 16 rollouts per GRPO group) and `--steps` more steps of
`--other-size`. Then it starts the viewer on loopback as `trace-proxy ui` does and measures,
with a real HTTP client: the index built at start, the step page (plain, sorted by reward
spread, second page, text search over every record of the step), a trajectory, a comparison of
8 rollouts; and the memory the index holds per trajectory (RSS before and after indexing).

    python benchmarks/viewer.py                       # the run recorded in RESULTS.md
    python benchmarks/viewer.py --from traces --step-size 10000 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from trace_proxy.exporters.backends.jsonl import NAME_FILE
from trace_proxy.show import iter_records
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import start

ROLLOUTS = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def templates(store: Path) -> list[dict[str, Any]]:
    found = [r for _, r in iter_records(store) if r.get("record") == "trajectory"]
    if not found:
        raise SystemExit(f"no trajectories in {store}")
    return found


def write_store(root: Path, sources: list[dict[str, Any]], args: argparse.Namespace) -> int:
    directory = root / "bench" / "viewer"
    directory.mkdir(parents=True)
    (root / "bench" / NAME_FILE).write_text('"bench"')
    (directory / NAME_FILE).write_text('"viewer"')
    rng = random.Random(0)
    written = 0
    sizes = {1: args.step_size} | {s: args.other_size for s in range(2, args.steps + 2)}
    for step, size in sizes.items():
        with open(directory / f"step-{step:06d}.jsonl", "wb") as handle:
            for n in range(size):
                record = dict(sources[n % len(sources)])
                record["id"] = uuid.uuid4().hex
                record["key"] = {**record["key"], "project": "bench", "experiment": "viewer",
                                 "step": step, "sample_index": n // ROLLOUTS,
                                 "rollout_n": n % ROLLOUTS}  # fmt: skip
                record["reward"] = float(rng.random() < 0.4 + 0.02 * step)
                handle.write(orjson.dumps(record) + b"\n")
                written += 1
    return written


async def timed_get(session: aiohttp.ClientSession, url: str, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        async with session.get(url) as response:
            body = await response.read()
            assert response.status == 200, (url, response.status, body[:200])
        times.append(time.perf_counter() - began)
    return times


async def measure(store: Path, rounds: int) -> dict[str, Any]:
    gc.collect()
    before = rss_bytes()
    began, cpu = time.perf_counter(), time.process_time()
    runner, url, viewer = await start([store], "127.0.0.1", 0)
    indexed, indexed_cpu = time.perf_counter() - began, time.process_time() - cpu
    gc.collect()
    index: StoreIndex = viewer.index
    trajectories = sum(r.trajectories for r in index.runs.values())
    held = rss_bytes() - before
    run = next(iter(index.runs.values()))
    step = run.steps[(False, 1)]
    base = f"{url}run/0/bench/viewer"
    group = [e.id for e in step.entries[:ROLLOUTS]][:8]
    pages = {
        "step page (10,000 trajectories, groups by sample)": f"{base}/step/1",
        "step page sorted by reward spread": f"{base}/step/1?sort=spread",
        "step page, second page of groups": f"{base}/step/1?page=2",
        "step page, rollouts by reward, reward >= 1": f"{base}/step/1?order=reward&min=1",
        "step page, text search over the step's records": f"{base}/step/1?q=London",
        "steps of the run": f"{base}/",
        "a trajectory": f"{base}/t/{step.entries[5000].id}",
        "compare 8 rollouts of a group": f"{base}/compare?" + "&".join(f"id={i}" for i in group),
    }
    results = {}
    async with aiohttp.ClientSession() as session:
        for name, page in pages.items():
            times = await timed_get(session, page, rounds)
            results[name] = (statistics.median(times), max(times))
    await runner.cleanup()
    size = sum(p.stat().st_size for p in store.rglob("*.jsonl"))
    return {"indexed": indexed, "indexed_cpu": indexed_cpu, "trajectories": trajectories,
            "bytes": size, "held": held, "step": len(step.entries), "pages": results}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="a store to copy records from")
    parser.add_argument("--step-size", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=20, help="more steps besides the big one")
    parser.add_argument("--other-size", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5, help="requests per page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="viewer-bench-") as work:
        source = args.source
        if source is None:
            source = Path(work) / "demo"
            subprocess.run(
                [sys.executable, "-m", "trace_proxy", "demo", "--output", str(source)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        store = Path(work) / "store"
        written = write_store(store, templates(source), args)
        print(f"store: {written:,} trajectories", flush=True)
        result = asyncio.run(measure(store, args.rounds))
    print(f"indexed {result['trajectories']:,} trajectories ({result['bytes'] / 1e6:,.0f} MB) "
          f"at start in {result['indexed']:.2f} s ({result['indexed_cpu']:.2f} s CPU); "
          f"index memory {result['held'] / 1e6:.0f} MB "
          f"({result['held'] / result['trajectories']:.0f} bytes per trajectory)")  # fmt: skip
    print(f"| page (step of {result['step']:,} trajectories) | median s | max s |")
    print("|---|---|---|")
    for name, (median, worst) in result["pages"].items():
        print(f"| {name} | {median:.3f} | {worst:.3f} |")


if __name__ == "__main__":
    main()
