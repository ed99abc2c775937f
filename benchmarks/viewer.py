"""How fast `trace-proxy ui` opens big stores: indexing, a step of 10,000 trajectories, search.

Builds a store from a real one (the demo's, written by `trace-proxy demo` unless `--from` names
a store): every trajectory of the template store is copied with a new id, key and reward into
one big step (`--step-size`, 16 rollouts per GRPO group) and `--steps` more steps of
`--other-size`. Then it starts the viewer on loopback as `trace-proxy ui` does and measures,
with a real HTTP client: the index built at start, the step page (plain, sorted by reward
spread, second page, text search over every record of the step), a trajectory, a comparison of
8 rollouts; and the memory the index holds per trajectory (RSS before and after indexing).

Searching the whole run (`/search`, through the full-text index) is timed beside its naive
peer, reading every record of the run again and looking for the text (`StoreIndex.search`, what
the step page's filter does for one step). A rare word (`NEEDLE`) is put in one response of
every `NEEDLE_EVERY` records and every `AMBIGUOUS_EVERY`th key is marked ambiguous, so rare and
common matches and the marks are all measured. Indexing is timed without the full-text index
first (its cost is the difference), then as `trace-proxy ui` starts.

    python benchmarks/viewer.py                       # 30,000 trajectories
    python benchmarks/viewer.py --steps 90            # 100,000: the run recorded in RESULTS.md
    python benchmarks/viewer.py --from traces --step-size 10000 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import re
import resource
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

from trace_proxy.store.layout import NAME_FILE
from trace_proxy.store.readers import iter_records
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import start

ROLLOUTS = 16
NEEDLE, NEEDLE_EVERY = "zanzibar", 9_973
AMBIGUOUS_EVERY = 997


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
                if written % NEEDLE_EVERY == 0:
                    record["calls"] = with_needle(record["calls"])
                if written % AMBIGUOUS_EVERY == 0:
                    marked = {**record["key"].get("sources", {}),
                               "trajectory_id": "inferred:ambiguous"}  # fmt: skip
                    record["key"] = {**record["key"], "sources": marked}
                handle.write(orjson.dumps(record) + b"\n")
                written += 1
    return written


def with_needle(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls with NEEDLE in the first response (the template's own calls left alone)."""
    calls = orjson.loads(orjson.dumps(calls))
    output = calls[0]["outputs"][0]
    for name in ("text", "response_text"):
        if isinstance(output.get(name), str):
            output[name] += f" {NEEDLE}"
    return calls


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def timed_get(session: aiohttp.ClientSession, url: str, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        async with session.get(url) as response:
            body = await response.read()
            assert response.status == 200, (url, response.status, body[:200])
        times.append(time.perf_counter() - began)
    return times


def plain_index(store: Path) -> tuple[float, float]:
    """Seconds (wall, CPU) to build the index without the full-text one."""
    began, cpu = time.perf_counter(), time.process_time()
    StoreIndex([store]).refresh(True)
    return time.perf_counter() - began, time.process_time() - cpu


async def measure(store: Path, rounds: int) -> dict[str, Any]:
    plain = plain_index(store)
    gc.collect()
    before = rss_bytes()
    began, cpu = time.perf_counter(), time.process_time()
    runner, url, viewer = await start([store], "127.0.0.1", 0)
    indexed, indexed_cpu = time.perf_counter() - began, time.process_time() - cpu
    gc.collect()
    index: StoreIndex = viewer.index
    trajectories = sum(r.trajectories for r in index.runs.values())
    held = rss_bytes() - before
    text_bytes = viewer.text.path.stat().st_size
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
        "a trajectory": f"{base}/t/{step.entries[len(step.entries) // 2].id}",
        "compare 8 rollouts of a group": f"{base}/compare?" + "&".join(f"id={i}" for i in group),
    }
    searches = {
        f"run search: a rare word ({NEEDLE})": f"{base}/search?q={NEEDLE}",
        "run search: a common word (London)": f"{base}/search?q=London",
        "run search: London, page 100": f"{base}/search?q=London&page=100",
        'run search: a phrase ("the answer")': f"{base}/search?q=%22the+answer%22",
        "run search: London and reward >= 1": f"{base}/search?q=London&min_reward=1",
        "run search: reward >= 1, steps 10-40": f"{base}/search?"
        + "min_reward=1&min_step=10&max_step=40",
        "run search: status error": f"{base}/search?status=error",
        "run search: ambiguous keys": f"{base}/search?ambiguous=1",
        "run search: tool get_weather": f"{base}/search?tool=get_weather",
    }
    results, found = {}, {}
    async with aiohttp.ClientSession() as session:
        for name, page in pages.items():
            times = await timed_get(session, page, rounds)
            results[name] = (statistics.median(times), max(times))
        for name, page in searches.items():
            times = await timed_get(session, page, rounds)
            results[name] = (statistics.median(times), max(times))
            async with session.get(page) as response:
                counted = re.search(r"([\d,]+) trajectories found", await response.text())
            found[name] = counted.group(1) if counted else "?"
    entries = [e for s in run.steps.values() for e in s.entries]
    for word in (NEEDLE, "London"):
        began = time.perf_counter()
        hits = await asyncio.to_thread(index.search, entries, word)
        name = f"naive peer: every record of the run read for {word}"
        results[name] = (time.perf_counter() - began,) * 2
        found[name] = f"{len(hits):,}"
    peak = peak_rss_bytes()
    await runner.cleanup()
    size = sum(p.stat().st_size for p in store.rglob("*.jsonl"))
    return {"indexed": indexed, "indexed_cpu": indexed_cpu, "trajectories": trajectories,
            "bytes": size, "held": held, "step": len(step.entries), "pages": results,
            "plain": plain, "text_bytes": text_bytes, "found": found, "rss": rss_bytes(),
            "peak": peak}  # fmt: skip


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
    print(f"without the full-text index: {result['plain'][0]:.2f} s "
          f"({result['plain'][1]:.2f} s CPU); full-text index on disk "
          f"{result['text_bytes'] / 1e6:,.0f} MB; RSS at the end {result['rss'] / 1e6:,.0f} MB, "
          f"peak {result['peak'] / 1e6:,.0f} MB")  # fmt: skip
    print(f"| page (step of {result['step']:,} trajectories) | median s | max s | found |")
    print("|---|---|---|---|")
    for name, (median, worst) in result["pages"].items():
        print(f"| {name} | {median:.3f} | {worst:.3f} | {result['found'].get(name, '')} |")


if __name__ == "__main__":
    main()
