"""RESULTS.md: the numbers with the command, machine, versions, checks and caveats they need."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from datetime import datetime
from functools import partial

from benchlib.procs import Placement
from benchlib.report import DIRECT, Cell, Checks, Row, results_table, rounds_table
from benchlib.workload import LATENCY_SIGMA, OUTPUT_TOKENS, TOOL_TOKENS, build_turns, parse_mode

LIMITS = """\
- **The load generator is Python.** Its CPU use is in the per-cell table; at concurrency 64 it
  is close to a full core, so direct's throughput is a client-bound figure, not the upstream's
  capacity.
- **The slow-upstream modes (`-500ms`, `-250ms`, `-2s`) are the rollout's shape**: many calls
  in flight, each waiting on a generation, so the request rate is what the upstream allows and
  the machine is not saturated by the load generator. There the added latency is what a
  rollout feels; it is measured call by call (latency minus the upstream's reported wait), so
  the spread of generation times does not blur it. At 512 in flight the rates are still high
  for one RL server (hundreds to a few thousand calls per second with these medians; real
  generations take seconds).
- **Concurrency 1 is a loopback round trip through Python event loops.** The added latency is
  the per-hop cost of the proxy; a real vLLM call takes from tens of milliseconds to minutes, so
  compare the added milliseconds with that, not with the sub-millisecond direct latency here.
- **At concurrency 64 latency is mostly queueing** (≈ 64 / throughput, Little's law): the added
  p50 there follows from the lower throughput rather than from extra work per request.
- **trace-proxy records after the response**: once the client has its answer, the forwarding
  process writes the exchange's raw bytes to its capture process (at nice 19, so forwarding
  has the cores first), which parses and assembles it; closed trajectories are appended to
  the spool by a writer thread there, and the export process (its own interpreter, under
  SCHED_IDLE) writes the jsonl store from the spool. The benchmark charges all of it to
  trace-proxy (its CPU and memory include every process under it) and waits for the backlog
  to drain before the next cell, so it does not slow the next system; the drain time is
  reported in the checks.
- **Recording can fall behind for want of CPU.** When the proxy's cores are saturated by
  forwarding (the closed-loop cells with 8k and 32k prompts at 64 and 512 in flight here), the
  capture process at nice 19 gets what is left; its backlog grows to `--capture-queue-bytes`,
  then exchanges are counted as dropped in their trajectories (the "dropped" column of the
  per-cell table, and a target row) rather than slowing forwarding. The slow-upstream cells,
  at a rollout's rates, leave it room.
- **trace-proxy-inline** is the same, with parsing and assembling on the forwarding process's
  event loop (`--capture-mode inline`, the design before the capture process): the two side by
  side are the measured effect of moving capture out.
- **trace-proxy-sampled and trace-proxy-off** are separate trace-proxy processes keeping 10% of
  the samples and none: a rate and keeping none need no state, so the proxy refuses a dropped
  sample's calls from their headers and hands only their heads to the capture process, which
  counts them. trace-proxy-off is forwarding plus that hand-over, the "tracing off" baseline.
- **LiteLLM** (one uvicorn worker, logging off) re-serialises requests and responses; with
  these 1k-token-id prompts it spends 30-80 ms of CPU per request here (measured, not profiled:
  where it goes inside LiteLLM is not known). Its log shows it opening new HTTP client
  sessions under load ("Unclosed connector"). It is measured as installed, with the
  configuration in benchlib/litellm.py; its own published figures are for other prompts and
  machines.
- **trace-proxy-unrecorded** is the same trace-proxy process forwarding the same requests on a
  path it does not record (`/bench/unrecorded/v1/completions`, which the upstream also answers):
  forwarding alone, no tap, no parsing, no store. trace-proxy minus trace-proxy-unrecorded is
  the cost of recording.
- **nginx runs one worker** (`worker_processes 1`), as trace-proxy runs one event loop; it is
  the floor for any keep-alive reverse proxy on this machine.
- **Noise.** Other processes on the machine are visible in "other CPU (cores)" per cell. Rounds
  rotate the order of the systems and the tables show medians across rounds; added latency and
  the throughput ratio are medians of per-round comparisons with the direct cell of the same
  round. A p99 from a few seconds of a cell rests on its few dozen slowest requests: it moves
  by milliseconds from run to run, so compare p99s across runs as a range, not to the digit.
"""


def _cores(placement: Placement) -> str:
    if placement.pinned:
        return """\
- **The proxy has cores of its own.** The load generator (one Python/aiohttp process) and the
  upstream (one Python process) share the load side's CPUs; the system under test runs on the
  others, every process of it (trace-proxy's forwarder, capture and export processes; nginx's
  worker), as a sidecar does on a GPU node, where the rollout's client and the inference
  server run elsewhere. Direct leaves those CPUs idle. In the closed-loop cells at concurrency
  64 and more the load side is saturated, so throughput is bounded by it: a proxy that keeps
  up shows close to 1.0 vs direct, and one that does not shows its own limit. trace-proxy's
  recording (capture and export processes) shares the proxy's CPUs with its forwarding
  there, at a lower priority. `--pin off` measures the other question, how much CPU a proxy
  takes away from a client and server on the same cores.
"""
    return """\
- **Everything shares the same cores** (`--pin off`). The load generator (one Python/aiohttp
  process), the upstream (one Python process) and the proxy under test run on the same cores.
  Direct has two busy processes; a proxied run has three. When the machine is saturated,
  "req/s vs direct" measures how much CPU the proxy takes away from the load generator and
  upstream, not how many requests the proxy could serve on a core of its own. "proxy CPU
  µs/req" (CPU time of the proxy's processes during the cell divided by the requests it
  forwarded) is the number that does not depend on that contention.
"""


def render(
    command: str,
    when: datetime,
    seconds: float,
    environment: dict[str, str],
    args: argparse.Namespace,
    rows: list[Row],
    cells: list[Cell],
    checks: Checks,
    facts: list[str],
) -> str:
    load = os.getloadavg()
    machine = (
        f"{environment['cores']} cores ({environment['cpu']}), {environment['memory']} RAM, "
        f"{environment['kernel']}; load average at start {environment['load average at start']},"
        f" at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    versions = (
        f"Python {environment['python']} ({environment['loop']}), {environment['packages']}, "
        f"trace-proxy {environment['trace-proxy']}"
        + (f", nginx {environment['nginx']}" if "nginx" in environment else "")
        + (f", LiteLLM {environment['litellm']}" if "litellm" in environment else "")
    )
    parts = [
        "# trace-proxy overhead benchmark: results\n",
        "Written by `benchmarks/overhead.py` (see [README.md](README.md)); run the command "
        "below to regenerate it.\n",
        f"- **Command:** `{command}`",
        f"- **Date:** {when:%Y-%m-%d %H:%M} UTC; the run took {seconds:.0f} s",
        f"- **Machine:** {machine}",
        f"- **CPUs:** {args.placement.describe()} (`--pin {args.pin}`)",
        f"- **Versions:** {versions}",
        f"- **Workload:** {_workload(args)}\n",
        "## Results (medians across rounds)\n",
        results_table(rows) + "\n",
        "p50/p99: latency of one whole request as the client sees it (send to last byte). "
        "added: proxy minus direct (in the slow-upstream modes, `-500ms` and the like: "
        "percentiles of each call's latency minus the wait the upstream reported). req/s vs "
        "direct: throughput ratio. proxy CPU µs/req: CPU time of the proxy's processes per "
        "forwarded request, recording included.\n",
        "## Checks\n",
        *(f"- {line}" for line in checks.lines()),
        "",
        "## Targets (computed from this run)\n",
        *_targets(rows, cells),
        "",
        "## Reading (computed from this run)\n",
        *_findings(rows, cells, args.noise_limit),
        f"- Memory: {'; '.join(facts)}." if facts else "",
        "",
        "## What limits these numbers\n",
        _cores(args.placement) + LIMITS,
        "## Every cell, in run order\n",
        rounds_table(cells) + "\n",
    ]
    return "\n".join(parts)


def _workload(args: argparse.Namespace) -> str:
    modes = [parse_mode(mode) for mode in args.modes]
    sizes = sorted({mode.prompt_tokens for mode in modes})
    described = []
    for size in sizes:
        turns = build_turns(args.turns, stream=False, seed=args.seed, prompt_tokens=size)
        requests = [len(t.request) for t in turns]
        responses = [len(t.response) for t in turns]
        prompt_max = size + (args.turns - 1) * (OUTPUT_TOKENS + TOOL_TOKENS)
        described.append(
            f"{size}-{prompt_max} ids ({min(requests) / 1000:.1f}-{max(requests) / 1000:.1f} kB "
            f"requests, {min(responses) / 1000:.1f}-{max(responses) / 1000:.1f} kB responses, "
            "which echo the prompt's ids)"
        )
    rates = [f"{mode.rate:g}" for mode in modes if mode.rate is not None]
    slow = [mode.name for mode in modes if mode.latency_ms is not None]
    fixed = [mode.name for mode in modes if mode.fixed]
    shared = [mode.name for mode in modes if mode.shared]
    exactly = (
        f" (`-fixed` modes, {', '.join(f'`{name}`' for name in fixed)}: exactly that time)"
        if fixed
        else ""
    )
    slow_upstream = (
        f"; slow-upstream modes ({', '.join(f'`{name}`' for name in slow)}): each call asks the "
        f"upstream to take a generation time (for a stream, the time to its first event) drawn "
        f"from a lognormal distribution with that median and sigma {LATENCY_SIGMA:g} (p99 "
        f"{math.exp(2.326 * LATENCY_SIGMA):.1f}x the median){exactly}, the same for the same "
        "call through every system, run at the concurrencies of 64 and more after a warm-up of "
        "4 medians and measured for at least 5; their added latency is computed from each "
        "call's latency minus the wait the upstream reports"
        if slow
        else ""
    )
    open_loop = (
        f"; open loop (`@RATE/s` modes) at {', '.join(rates)} requests/s, latency counted from "
        "each request's scheduled start, at most 512 in flight"
        if rates
        else ""
    )
    sharing = (
        f"; `-shared` modes ({', '.join(f'`{name}`' for name in shared)}) run unpinned whatever "
        "`--pin` says: the system under test shares every core with the load generator and the "
        "upstream, as a sidecar without a core of its own does"
        if shared
        else ""
    )
    return (
        f"`POST /v1/completions` as vLLM serves it, token-id prompts of "
        f"{'; '.join(described)} (`-8k`/`-32k` modes: the longer prompts), {OUTPUT_TOKENS} "
        f"output tokens with logprobs and `return_token_ids` (`sse` = the same streamed as a "
        f"few SSE events and `[DONE]`, {getattr(args, 'chunk_interval_ms', 0):g} ms apart); "
        f"trajectories of {args.turns} sequential turns sent with "
        f"X-Rollout-Step/Sample-Index/N headers; closed loop at concurrency "
        f"{', '.join(map(str, args.concurrency))}"
        + (f" with a {args.think_ms:g} ms pause after each response" if args.think_ms else "")
        + open_loop
        + slow_upstream
        + sharing
        + f"; {args.warmup:g} s warm-up and "
        f"{args.duration:g} s measured per cell; {args.rounds} rounds, system order rotated "
        f"each round; a cell during which other processes used more than "
        f"{args.noise_limit:g} cores was run again (at most 2 re-runs per cell, "
        f"{args.retries} in all) and the quietest attempt kept."
    )


def _targets(rows: list[Row], cells: list[Cell]) -> list[str]:
    """Each target for trace-proxy recording every call, judged cell by cell: how many cells
    meet it, and the measured values of those that do not."""
    table = [
        "| target (trace-proxy, every call recorded) | met in | not met (measured) |",
        "|---|---|---|",
    ]

    def judge(target: str, judged: list[tuple[str, bool, str]]) -> None:
        if judged:
            misses = "; ".join(f"{where} {value}" for where, ok, value in judged if not ok)
            met = sum(ok for _, ok, _ in judged)
            table.append(f"| {target} | {met} of {len(judged)} cells | {misses or '-'} |")

    mine = [r for r in rows if r.system == "trace-proxy"]
    closed = [r for r in mine if parse_mode(r.mode).rate is None]
    for concurrency in (1, 64):
        judge(
            f"added p50 <= 0.5 ms and p99 <= 2 ms at concurrency {concurrency}",
            [
                (r.mode, r.added_p50 <= 0.5 and r.added_p99 <= 2.0,
                 f"{r.added_p50:+.2f}/{r.added_p99:+.2f} ms")
                for r in closed
                if r.concurrency == concurrency
                and r.added_p50 is not None and r.added_p99 is not None
            ],
        )  # fmt: skip
    judge(
        "added p99 <= 5 ms with 512 in flight (closed loop; open loop: at most 512)",
        [
            (_where(r), r.added_p99 <= 5.0, f"{r.added_p99:+.1f} ms")
            for r in mine
            if r.concurrency == 512 and r.added_p99 is not None
        ],
    )
    versus_off = [(r, _same(rows, r, "trace-proxy-off")) for r in closed]
    judge(
        "throughput >= 90% of tracing off (closed loop)",
        [
            (_where(r), r.rps >= 0.9 * off.rps, f"{r.rps / off.rps:.0%}")
            for r, off in versus_off
            if off is not None and off.rps
        ],
    )
    judge("every call recorded, none dropped for want of CPU", _dropped(mine, cells))
    versus_nginx = [(r, _same(rows, r, "nginx")) for r in mine]
    judge(
        "CPU per request <= 3x nginx's",
        [
            (_where(r), r.cpu_us <= 3 * nginx.cpu_us,
             f"{r.cpu_us / nginx.cpu_us:.1f}x")
            for r, nginx in versus_nginx
            if nginx is not None and nginx.cpu_us and r.cpu_us
        ],
    )  # fmt: skip
    judge("streaming at a fixed rate: first byte +<= 1 ms (p50), p99 gap +<= 0.5 ms",
          _streaming_targets(cells))  # fmt: skip
    versus_litellm = [(r, _same(rows, r, "litellm")) for r in mine]
    judge(
        ">= 5x LiteLLM's throughput and <= 1/5 of its added p99",
        [
            (_where(r),
             r.rps >= 5 * peer.rps and r.added_p99 <= peer.added_p99 / 5,
             f"{r.rps / peer.rps:.1f}x, {r.added_p99:+.1f} vs {peer.added_p99:+.1f} ms")
            for r, peer in versus_litellm
            if peer is not None and peer.rps and peer.added_p99 and r.added_p99 is not None
        ],
    )  # fmt: skip
    table.append(
        "| RSS < 300 MB and flat over a 10-minute soak | see the soak section below (`soak.py`) | |"
    )
    return table


def _dropped(mine: list[Row], cells: list[Cell]) -> list[tuple[str, bool, str]]:
    """Per mode and concurrency, the share of calls the store counts as dropped (kept cells,
    every round); nothing to judge when the store was not read."""
    judged = []
    for row in mine:
        same = [
            c for c in cells
            if (c.system, c.mode, c.concurrency) == ("trace-proxy", row.mode, row.concurrency)
            and c.dropped is not None
        ]  # fmt: skip
        sent = sum(int(c.load["sent"]) for c in same)
        if sent:
            dropped = sum(c.dropped or 0 for c in same)
            judged.append((_where(row), not dropped, f"{dropped / sent:.0%} dropped"))
    return judged


def _where(row: Row) -> str:
    return row.mode if parse_mode(row.mode).rate is not None else f"{row.mode} c={row.concurrency}"


def _streaming_targets(cells: list[Cell]) -> list[tuple[str, bool, str]]:
    """Streams at a set aggregate rate: opened at a fixed rate, or kept 512 in flight against
    a slow upstream (its time to the first event taken out, call by call)."""
    judged = []
    for mode, concurrency in sorted({(c.mode, c.concurrency) for c in cells}):
        spec = parse_mode(mode)
        if not spec.stream or (
            spec.rate is None and (spec.latency_ms is None or concurrency < 512)
        ):
            continue
        mine = [c for c in cells if (c.mode, c.concurrency) == (mode, concurrency)]

        median = partial(_load_median, mine)
        first_byte = _first_byte_figure(mode)
        first, gap = median("trace-proxy", first_byte), median("trace-proxy", "gap_p99_ms")
        direct_first, direct_gap = median(DIRECT, first_byte), median(DIRECT, "gap_p99_ms")
        if None in (first, gap, direct_first, direct_gap):
            continue
        assert first is not None and gap is not None
        assert direct_first is not None and direct_gap is not None
        added_first, added_gap = first - direct_first, gap - direct_gap
        where = mode if spec.rate is not None else f"{mode} c={concurrency}"
        judged.append((where, added_first <= 1.0 and added_gap <= 0.5,
                       f"{added_first:+.2f}/{added_gap:+.2f} ms"))  # fmt: skip
    return judged


def _first_byte_figure(mode: str) -> str:
    """The first byte's time from sending, less the upstream's wait when it was asked to."""
    slow = parse_mode(mode).latency_ms is not None
    return "first_byte_overhead_p50_ms" if slow else "first_byte_p50_ms"


def _load_median(cells: list[Cell], system: str, what: str) -> float | None:
    """One figure of the load generator's, over a system's cells (missing and NaN left out)."""
    found = [c.load.get(what) for c in cells if c.system == system]
    values = [float(v) for v in found if v is not None and v == v]
    return statistics.median(values) if values else None


def _findings(rows: list[Row], cells: list[Cell], noise_limit: float) -> list[str]:
    """Plain sentences for each mode and concurrency, plus noise and recording lag."""
    lines = []
    groups = dict.fromkeys((r.mode, r.concurrency) for r in rows)
    for mode, concurrency in groups:
        mine = [r for r in rows if (r.mode, r.concurrency) == (mode, concurrency)]
        said = [_sentence(r) for r in mine if r.system != DIRECT]
        direct = next((r for r in mine if r.system == DIRECT), None)
        rate = parse_mode(mode).rate
        load = f"open loop at {rate:g}/s" if rate is not None else f"concurrency {concurrency}"
        head = f"- **{mode}, {load}**"
        if direct is not None:
            head += f" (direct: p50 {direct.p50:.3f} ms, {direct.rps:.0f} req/s)"
        lines.append(head + ": " + "; ".join(said) + ".")
    ratio = _cpu_ratio(rows)
    if ratio:
        lines.append(f"- {ratio}")
    versus = _versus_litellm(rows)
    if versus:
        lines.append(f"- {versus}")
    lines += [f"- {line}" for line in _streaming(cells)]
    for versus in (_versus_off(rows), _versus_inline(rows)):
        if versus:
            lines.append(f"- {versus}")
    others = [c.other_cores for c in cells]
    noisy = sum(1 for c in cells if c.other_cores > noise_limit)
    lines.append(
        f"- Other processes on the machine used {statistics.median(others):.2f} cores (median "
        f"over the kept cells), {max(others):.2f} at most; {noisy} of {len(cells)} kept cells "
        f"had more than {noise_limit:g} cores of such load"
        + (" (see the last table): treat those with care." if noisy else ".")
    )
    return lines


def _sentence(row: Row) -> str:
    """What one proxy costs; its cores in use show whether it, not the client, is the limit."""
    cores = (row.cpu_us or 0) * row.rps / 1e6
    return (
        f"{row.system} adds {row.added_p50 or 0:+.3f} ms at p50 and {row.added_p99 or 0:+.3f} "
        f"ms at p99, at {row.rps_ratio or 0:.0%} of direct's throughput, "
        f"{row.cpu_us or 0:.0f} µs CPU per request ({cores:.2f} cores busy)"
    )


def _cpu_ratio(rows: list[Row]) -> str:
    """trace-proxy's CPU per request next to nginx's and next to its own unrecorded forwarding."""
    pairs = []
    for r in rows:
        if r.system != "trace-proxy" or not r.cpu_us:
            continue
        nginx = _same(rows, r, "nginx")
        bare = _same(rows, r, "trace-proxy-unrecorded")
        said = f"{r.mode}, c={r.concurrency}: {r.cpu_us:.0f} µs"
        if nginx and nginx.cpu_us:
            said += f" = {r.cpu_us / nginx.cpu_us:.1f}x nginx's {nginx.cpu_us:.0f} µs"
        if bare and bare.cpu_us:
            share = (r.cpu_us - bare.cpu_us) / r.cpu_us
            said += f", {share:.0%} of it recording (unrecorded route: {bare.cpu_us:.0f} µs)"
        pairs.append(said)
    return "trace-proxy CPU per request: " + "; ".join(pairs) + "." if pairs else ""


def _streaming(cells: list[Cell]) -> list[str]:
    """sse cells: time to the first body bytes and the p99 gap between reads, vs direct's;
    for an open loop, also the SSE events per second it streams in all."""
    lines = []
    loads = sorted({(c.mode, c.concurrency) for c in cells if parse_mode(c.mode).stream})
    for mode, concurrency in loads:
        mine = [c for c in cells if c.mode == mode and c.concurrency == concurrency]

        median = partial(_load_median, mine)
        first_byte = _first_byte_figure(mode)
        direct_first, direct_gap = median(DIRECT, first_byte), median(DIRECT, "gap_p99_ms")
        if direct_first is None or direct_gap is None:
            continue
        said = []
        for system in dict.fromkeys(c.system for c in mine if c.system != DIRECT):
            first, gap = median(system, first_byte), median(system, "gap_p99_ms")
            if first is not None and gap is not None:
                said.append(f"{system} adds {first - direct_first:+.3f} ms to the first byte "
                            f"(p50) and {gap - direct_gap:+.3f} ms to the p99 gap")  # fmt: skip
        parsed = parse_mode(mode)
        if parsed.rate is None and parsed.latency_ms is not None:
            load = (f"{mode}, concurrency {concurrency}, the upstream's wait before the first "
                    "event taken out of the first byte's time")  # fmt: skip
        elif parsed.rate is None:
            load = f"{mode}, concurrency {concurrency}"
        else:
            events = len(build_turns(1, stream=True, seed=0, prompt_tokens=parsed.prompt_tokens)[0]
                         .chunks)  # fmt: skip
            load = (f"{mode}, open loop: {events} SSE events per response, "
                    f"{parsed.rate * events:,.0f} events/s in all")  # fmt: skip
        lines.append(
            f"Streaming, {load} (direct: first byte p50 {direct_first:.3f} "
            f"ms, p99 gap between reads {direct_gap:.3f} ms): " + "; ".join(said) + "."
        )
    return lines


def _versus_off(rows: list[Row]) -> str:
    """The cost of tracing itself: recording everything, or a 10% sample, vs tracing off."""
    pairs = []
    for r in rows:
        off = _same(rows, r, "trace-proxy-off") if r.system == "trace-proxy" else None
        sampled = _same(rows, r, "trace-proxy-sampled") if r.system == "trace-proxy" else None
        if off is None or not off.rps:
            continue
        said = f"{r.mode}, c={r.concurrency}: 100% kept {r.rps / off.rps:.0%}"
        if sampled is not None:
            said += f", 10% kept {sampled.rps / off.rps:.0%}"
        pairs.append(said)
    return "Throughput vs tracing off (target >= 90%): " + "; ".join(pairs) + "." if pairs else ""


def _versus_inline(rows: list[Row]) -> str:
    """The architecture's effect: capture in its own process vs on the forwarding loop."""
    pairs = []
    for r in rows:
        inline = _same(rows, r, "trace-proxy-inline") if r.system == "trace-proxy" else None
        if inline is None or not inline.rps or r.added_p99 is None or inline.added_p99 is None:
            continue
        pairs.append(
            f"{r.mode}, c={r.concurrency}: {r.rps / inline.rps:.2f}x its throughput, added "
            f"p99 {r.added_p99:+.2f} ms vs {inline.added_p99:+.2f} ms"
        )
    return (
        "Capture process vs capture inline (trace-proxy vs trace-proxy-inline): "
        + "; ".join(pairs)
        + "."
        if pairs
        else ""
    )


def _versus_litellm(rows: list[Row]) -> str:
    """The peer target: >= 5x LiteLLM's throughput and <= 1/5 of its added p99."""
    pairs = []
    for r in rows:
        peer = _same(rows, r, "litellm") if r.system == "trace-proxy" else None
        if peer is None or not peer.rps or not peer.added_p99 or r.added_p99 is None:
            continue
        pairs.append(
            f"{r.mode}, c={r.concurrency}: {r.rps / peer.rps:.1f}x its throughput, "
            f"added p99 {r.added_p99:+.2f} ms vs {peer.added_p99:+.2f} ms "
            f"({r.added_p99 / peer.added_p99:.3f} of it)"
        )
    return "trace-proxy (100% recorded) vs LiteLLM: " + "; ".join(pairs) + "." if pairs else ""


def _same(rows: list[Row], like: Row, system: str) -> Row | None:
    return next(
        (
            r
            for r in rows
            if r.system == system and (r.mode, r.concurrency) == (like.mode, like.concurrency)
        ),
        None,
    )
