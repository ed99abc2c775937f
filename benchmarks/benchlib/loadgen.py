"""Load generator: closed loop (N workers) or open loop (a fixed rate); one JSON report.

Run as its own process (`python -m benchlib.loadgen --url ... --concurrency 64 ...`) so it
does not share an event loop with what it measures. Trajectories are `turns` sequential calls
(the shape of an agentic RL rollout) with X-Rollout-* headers; every response body is checked
against the exact bytes the upstream sends. Requests completing during the warm-up are not
measured. Bounded in time (warm-up + duration) and in count.

Closed loop: each of `concurrency` workers runs trajectories back to back. Open loop
(`--rate R`): requests start on a fixed schedule, R per second, whatever the answers do; each
takes the next turn of a trajectory whose previous turn has finished, else starts a new one.
Latency counts from the scheduled start, so a system that falls behind is charged for the
queueing it causes (no coordinated omission). At most `concurrency` requests are in flight;
an arrival beyond that is counted as missed.

With `--latency-ms M`, each call asks the upstream to take a generation time drawn from a
lognormal distribution around M (the same for the same call through every system), and the
upstream says how long it waited; a call's *overhead* is its latency minus that wait: what the
transport and any proxy in between added, measured call by call rather than as a difference of
two noisy percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import hashlib
import itertools
import json
import math
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchlib.aio import run
from benchlib.workload import (
    DELAY_HEADER,
    LATENCY_SIGMA,
    PROMPT_TOKENS,
    WAITED_HEADER,
    Turn,
    build_turns,
    generation_delay_us,
    rollout_headers,
)


@dataclass(frozen=True)
class LoadSpec:
    url: str
    concurrency: int
    warmup: float
    duration: float
    max_requests: int
    turns: int
    stream: bool
    step: int
    seed: int
    timeout: float
    think: float  # seconds a worker pauses after each response (0: back to back)
    prompt_tokens: int = PROMPT_TOKENS
    rate: float | None = None  # open loop: requests per second
    rollouts: int = 1  # trajectories per sample index (GRPO), consecutive ones sharing it
    latency_ms: float | None = None  # median generation time the upstream is asked to take
    latency_sigma: float = LATENCY_SIGMA

    def headers(self, trajectory: int, turn: int, turns: int) -> dict[str, str]:
        sample, rollout = divmod(trajectory, self.rollouts)
        headers = rollout_headers(self.step, sample, done=turn == turns - 1, rollout=rollout)
        if self.latency_ms is not None:
            delay = generation_delay_us(
                self.latency_ms, self.latency_sigma, self.seed, trajectory, turn
            )
            headers[DELAY_HEADER] = str(delay)
        return headers


@dataclass
class Tally:
    """What the workers saw; the measured window is [warm_end, measure_end]."""

    warm_end: float
    measure_end: float
    max_measured: int
    max_sent: int
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)  # send to first body bytes
    gaps: list[float] = field(default_factory=list)  # between body reads of one response
    overheads: list[float] = field(default_factory=list)  # latency minus the upstream's wait
    first_byte_overheads: list[float] = field(default_factory=list)
    unwaited: int = 0  # measured answers to a delayed request that did not say their wait
    sent: int = 0
    warmed: int = 0
    trajectories: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    mismatched: int = 0
    mismatch_sample: str | None = None
    digests: dict[int, str] = field(default_factory=dict)
    stopped: bool = False
    missed: int = 0  # open loop: arrivals dropped because `concurrency` were in flight

    def issuing(self) -> bool:
        """Workers start new requests only inside the time and count bounds."""
        if self.stopped or self.sent >= self.max_sent or time.perf_counter() >= self.measure_end:
            self.stopped = True
        return not self.stopped

    def measure(
        self,
        start: float,
        end: float,
        arrivals: list[float] | None = None,
        waited: float | None = None,
    ) -> None:
        """Keep the latency of a request that completed inside the window (and, when the
        upstream said how long it waited, the overhead). The warm-up is bounded by the same
        count as the window: it ends early after `max_measured` requests."""
        if end < self.warm_end:
            self.warmed += 1
            if self.warmed >= self.max_measured:
                self.measure_end -= self.warm_end - end
                self.warm_end = end
            return
        if end <= self.measure_end and len(self.latencies) < self.max_measured:
            self.latencies.append(end - start)
            if arrivals:
                self.first_bytes.append(arrivals[0] - start)
                self.gaps.extend(b - a for a, b in itertools.pairwise(arrivals))
            if waited is not None:
                self.overheads.append(end - start - waited)
                if arrivals:
                    self.first_byte_overheads.append(arrivals[0] - start - waited)
            if len(self.latencies) == self.max_measured:
                self.measure_end = end
                self.stopped = True


async def _request(
    session: aiohttp.ClientSession,
    spec: LoadSpec,
    turn: Turn,
    index: int,
    headers: dict[str, str],
    tally: Tally,
    scheduled: float | None = None,
) -> None:
    start = time.perf_counter() if scheduled is None else scheduled
    tally.sent += 1
    try:
        async with session.post(spec.url, data=turn.request, headers=headers) as response:
            parts = []
            arrivals = []  # when each read of the body completed: first byte, then the gaps
            async for chunk in response.content.iter_any():
                arrivals.append(time.perf_counter())
                parts.append(chunk)
            body = b"".join(parts)
            status = response.status
            waited = response.headers.get(WAITED_HEADER)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally.errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
        await asyncio.sleep(0.01)  # an unreachable target must not become a hot loop
        return
    end = time.perf_counter()
    tally.statuses[status] += 1
    tally.digests.setdefault(index, hashlib.sha256(body).hexdigest())
    if body != turn.response:
        tally.mismatched += 1
        tally.mismatch_sample = (
            tally.mismatch_sample or f"turn {index}, status {status}: {body[:200]!r}"
        )
    if waited is None and DELAY_HEADER in headers:
        tally.unwaited += 1
    tally.measure(start, end, arrivals, None if waited is None else int(waited) / 1e6)


async def _worker(
    session: aiohttp.ClientSession, spec: LoadSpec, turns: list[Turn], tally: Tally
) -> None:
    """Run whole trajectories back to back; each is a new sample index of this step."""
    while tally.issuing():
        sample = tally.trajectories
        tally.trajectories += 1
        for index, turn in enumerate(turns):
            if not tally.issuing():
                return
            headers = spec.headers(sample, index, len(turns))
            await _request(session, spec, turn, index, headers, tally)
            if spec.think > 0:
                await asyncio.sleep(spec.think)


async def _open_loop(
    session: aiohttp.ClientSession, spec: LoadSpec, turns: list[Turn], tally: Tally
) -> None:
    """Start requests on a fixed schedule; late timer wake-ups start the overdue ones at once."""
    assert spec.rate is not None
    interval = 1 / spec.rate
    ready: collections.deque[tuple[int, int]] = collections.deque()  # (sample, next turn)
    running: set[asyncio.Task[None]] = set()

    async def one(sample: int, index: int, scheduled: float) -> None:
        done = index == len(turns) - 1
        headers = spec.headers(sample, index, len(turns))
        await _request(session, spec, turns[index], index, headers, tally, scheduled)
        if not done:
            ready.append((sample, index + 1))

    due = time.perf_counter()
    while tally.issuing():
        while due <= time.perf_counter() and tally.issuing():
            if len(running) >= spec.concurrency:
                tally.missed += 1
            else:
                if ready:
                    sample, index = ready.popleft()
                else:
                    sample, index = tally.trajectories, 0
                    tally.trajectories += 1
                task = asyncio.ensure_future(one(sample, index, due))
                running.add(task)
                task.add_done_callback(running.discard)
            due += interval
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    if running:
        await asyncio.gather(*running)


async def generate(spec: LoadSpec) -> dict[str, Any]:
    """Run the warm-up and the measured window; return the summary as plain JSON data."""
    turns = build_turns(spec.turns, spec.stream, spec.seed, spec.prompt_tokens)
    gc.freeze()  # the canned payloads live forever; keep the collector off them
    connector = aiohttp.TCPConnector(limit=spec.concurrency, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    cpu_start = _cpu_seconds()
    started = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        now = time.perf_counter()
        tally = Tally(
            warm_end=now + spec.warmup,
            measure_end=now + spec.warmup + spec.duration,
            max_measured=spec.max_requests,
            max_sent=2 * spec.max_requests + 2 * spec.concurrency,  # a safety net
        )
        if spec.rate is not None:
            workers = [_open_loop(session, spec, turns, tally)]
        else:
            workers = [_worker(session, spec, turns, tally) for _ in range(spec.concurrency)]
        await asyncio.wait_for(asyncio.gather(*workers), spec.warmup + spec.duration + spec.timeout)
    return _summary(tally, _cpu_seconds() - cpu_start, time.perf_counter() - started)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (no interpolation between samples)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _summary(tally: Tally, cpu: float, elapsed: float) -> dict[str, Any]:
    latencies = sorted(tally.latencies)
    window = tally.measure_end - tally.warm_end
    ms = [v * 1000 for v in latencies]
    overheads = sorted(v * 1000 for v in tally.overheads)
    first_byte_overheads = sorted(v * 1000 for v in tally.first_byte_overheads)
    return {
        "measured": len(latencies),
        "window_s": window,
        "rps": len(latencies) / window if window > 0 else math.nan,
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": ms[-1] if ms else math.nan,
        "first_byte_p50_ms": percentile(sorted(v * 1000 for v in tally.first_bytes), 50),
        "first_byte_p99_ms": percentile(sorted(v * 1000 for v in tally.first_bytes), 99),
        "gap_p99_ms": percentile(sorted(v * 1000 for v in tally.gaps), 99),
        "gaps": len(tally.gaps),
        "overhead_p50_ms": percentile(overheads, 50),
        "overhead_p99_ms": percentile(overheads, 99),
        "overheads": len(overheads),
        "first_byte_overhead_p50_ms": percentile(first_byte_overheads, 50),
        "first_byte_overhead_p99_ms": percentile(first_byte_overheads, 99),
        "unwaited": tally.unwaited,
        "mean_ms": sum(ms) / len(ms) if ms else math.nan,
        "sent": tally.sent,
        "trajectories": tally.trajectories,
        "missed": tally.missed,
        "statuses": {str(k): v for k, v in tally.statuses.items()},
        "errors": dict(tally.errors),
        "mismatched": tally.mismatched,
        "mismatch_sample": tally.mismatch_sample,
        "digests": {str(k): v for k, v in sorted(tally.digests.items())},
        "cpu_s": cpu,
        "elapsed_s": elapsed,
    }


def parse_spec(argv: list[str]) -> LoadSpec:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--think", type=float, default=0.0)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--rate", type=float, default=None, help="open loop: requests/s")
    parser.add_argument("--rollouts", type=int, default=1, help="trajectories per sample index")
    parser.add_argument(
        "--latency-ms", type=float, default=None, help="median generation time of the upstream"
    )
    parser.add_argument("--latency-sigma", type=float, default=LATENCY_SIGMA)
    return LoadSpec(**vars(parser.parse_args(argv)))


def main() -> None:
    spec = parse_spec(sys.argv[1:])
    result: dict[str, Any] = {}

    async def go() -> None:
        result.update(await generate(spec))

    run(go())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
