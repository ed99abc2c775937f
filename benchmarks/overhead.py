"""What trace-proxy costs: latency and throughput vs. a direct connection, nginx and LiteLLM.

    python benchmarks/overhead.py [--duration 4] [--concurrency 1,64] [--output PATH]

One run starts a fast fake vLLM upstream, trace-proxy (recording to jsonl; also driven on a
route it does not record, to separate forwarding from recording) and nginx (keep-alive reverse
proxy) in their own processes, then drives each with a closed-loop load generator (its own
process) at each concurrency, in rounds that rotate the order of the systems. LiteLLM's proxy
runs too, with the same upstream as an OpenAI-compatible backend (installed once into a cached
venv: benchlib/litellm.py). It prints a table, checks that every response body was
byte-identical (LiteLLM re-serialises bodies: statuses only) and that trace-proxy's store holds
every call, and writes RESULTS.md. nginx comes from the Debian package.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchlib import checks as check
from benchlib import litellm, plots
from benchlib.environment import describe
from benchlib.procs import (
    BENCH_DIR,
    BenchError,
    Proc,
    child_env,
    find_nginx,
    machine_busy_seconds,
    parse_placement,
    pinned_to,
    run_on,
    start_nginx,
    start_trace_proxy,
    start_upstream,
    stop_on_sigterm,
)
from benchlib.recording import accounted_calls, read_store, scrape, wait_drained
from benchlib.report import DIRECT, Cell, Checks, aggregate, results_table
from benchlib.results import render
from benchlib.workload import PATH, PROMPT_TOKENS, UNRECORDED_PATH, parse_mode

TRACE_PROXY = check.TRACE_PROXY
UNRECORDED = check.UNRECORDED  # trace-proxy on a route it does not record: forwarding alone
NGINX = "nginx"
LITELLM = check.LITELLM
SAMPLED = "trace-proxy-sampled"  # keeps 10% of the samples: the rest refused before parsing
OFF = "trace-proxy-off"  # keeps none (--max-samples-per-step 0): tracing off, forwarding on
INLINE = "trace-proxy-inline"  # records everything, parsing in the forwarding process
VARIANTS = {
    SAMPLED: ["--sample-rate", "0.1"],
    OFF: ["--max-samples-per-step", "0"],
    INLINE: ["--capture-mode", "inline"],
}
SYSTEMS = (DIRECT, TRACE_PROXY, UNRECORDED, SAMPLED, OFF, INLINE, NGINX, LITELLM)
MODES = (
    "json", "sse", "json-8k", "json-32k", "json@500/s", "json@1500/s", "sse@1700/s",
    "json-500ms", "sse-250ms", "json-32k-2s", "json-100ms-fixed-shared",
)  # fmt: skip
OPEN_LOOP_IN_FLIGHT = 512  # an open-loop cell's cap on requests in flight
DRAIN_TIMEOUT = 120.0
SETTLE_TIMEOUT = 60.0
LOAD_TIMEOUT = 30.0  # per request; a peer that cannot answer 512 long prompts in time fails
QUIET_WAIT = 60.0  # seconds a run may spend in all waiting for other processes to calm down
QUIET_SAMPLE = 0.25
MAX_RERUNS_PER_CELL = 2  # a long burst next door should not eat the whole re-run budget


@dataclass
class Running:
    """The long-lived processes of a run and where to reach them."""

    upstream: Proc
    urls: dict[str, str]
    proxies: dict[str, Proc] = field(default_factory=dict)
    admin_url: str | None = None
    nginx_log: Path | None = None
    proxy_calls: int = 0  # recorded requests sent through trace-proxy so far (drain check)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="overhead.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add(
        "--duration",
        type=float,
        default=4.0,
        help="measured seconds per cell, at least 5 medians with a slow upstream [4]",
    )
    add("--warmup", type=float, default=0.5, help="warm-up seconds per cell, not measured [0.5]")
    add(
        "--requests",
        type=int,
        default=100_000,
        help="at most this many measured requests per cell (ends a cell early) [100000]",
    )
    add(
        "--concurrency",
        type=_ints,
        default=[1, 64, 512],
        help="closed-loop concurrencies [1,64,512]",
    )
    add("--rounds", type=int, default=3, help="rounds; the order of systems rotates [3]")
    add(
        "--modes",
        type=_modes,
        default=list(MODES),
        help="json (plain responses) or sse (streamed), with -8k or -32k for longer prompts\n"
        "(1k ids otherwise), -LATENCY (-500ms) for an upstream whose generation time is\n"
        "lognormal around that median (run at the concurrencies of 64 and more), and\n"
        "@RATE/s for an open loop at that fixed request rate\n"
        f"(at most {OPEN_LOOP_IN_FLIGHT} in flight) [{','.join(MODES)}]",
    )
    add(
        "--systems",
        type=_choices(SYSTEMS),
        default=list(SYSTEMS),
        help="direct, trace-proxy, trace-proxy-unrecorded, trace-proxy-sampled,\n"
        "trace-proxy-off, trace-proxy-inline, nginx, litellm [all]",
    )
    add(
        "--litellm",
        default=None,
        metavar="PATH",
        help="an existing `litellm` executable (default: installed once into\n"
        "~/.cache/trace-proxy-bench/litellm)",
    )
    add(
        "--think-ms",
        type=float,
        default=0.0,
        help="pause after each response, per worker (0: back to back) [0]",
    )
    add(
        "--noise-limit",
        type=float,
        default=0.3,
        help="a cell during which other processes used more cores than this is run again\n"
        "(the quietest attempt is kept); 0 disables [0.3]",
    )
    add(
        "--retries",
        type=int,
        default=8,
        help="at most this many such re-runs per run, 2 per cell [8]",
    )
    add("--turns", type=int, default=4, help="calls per trajectory [4]")
    add(
        "--chunk-interval-ms",
        type=float,
        default=2.0,
        help="the upstream's pause between the SSE events of a response (its token rate) [2]",
    )
    add(
        "--pin",
        default="auto",
        metavar="auto|off|LOAD:SYSTEM",
        help="CPUs of the load side (load generator and upstream) and of the system under\n"
        "test: auto splits this machine's in two halves (0:1 on 2 cores), so a proxy is\n"
        "measured with a core of its own, as a sidecar on a GPU node; off lets every\n"
        "process run anywhere [auto]",
    )
    add("--seed", type=int, default=1, help="seed of the canned token ids [1]")
    add("--output", type=Path, default=BENCH_DIR / "RESULTS.md", help="results file [RESULTS.md]")
    add(
        "--workdir",
        type=Path,
        default=None,
        help="keep logs, nginx config and the trace store here (default: a temporary\n"
        "directory, removed after a run whose checks all pass)",
    )
    args = parser.parse_args(argv)
    if DIRECT not in args.systems:
        parser.error("--systems must include direct: it is the baseline")
    if (
        not args.concurrency
        or min(args.concurrency) < 1
        or args.rounds < 1
        or args.duration <= 0
        or args.requests < 1
    ):
        parser.error("--concurrency, --rounds, --duration and --requests must be positive")
    return args


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _modes(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [parse_mode(value).name for value in values or ["?"]]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}: {text!r}")
        return values

    return parse


def start_all(args: argparse.Namespace, workdir: Path, stack: ExitStack) -> Running:
    """Start upstream and proxies; the stack stops them even if the run fails."""
    sizes = sorted({parse_mode(mode).prompt_tokens for mode in args.modes})
    load_cpus, system_cpus = args.placement.load, args.placement.system
    upstream, upstream_url = start_upstream(
        workdir, args.turns, args.seed, args.chunk_interval_ms, sizes, load_cpus
    )
    stack.callback(upstream.stop)
    running = Running(upstream, {DIRECT: upstream_url})
    if TRACE_PROXY in args.systems or UNRECORDED in args.systems:
        proxy, url, admin = start_trace_proxy(workdir, upstream_url, cpus=system_cpus)
        stack.callback(proxy.stop)
        for system in (TRACE_PROXY, UNRECORDED):
            running.proxies[system], running.urls[system] = proxy, url
        running.admin_url = admin
    for variant, extra in VARIANTS.items():
        if variant in args.systems:
            proc, url, _ = start_trace_proxy(
                workdir, upstream_url, variant, extra, cpus=system_cpus
            )
            stack.callback(proc.stop)
            running.proxies[variant], running.urls[variant] = proc, url
    if NGINX in args.systems:
        nginx, url, error_log = start_nginx(workdir, upstream_url, system_cpus)
        stack.callback(nginx.stop)
        running.proxies[NGINX], running.urls[NGINX] = nginx, url
        running.nginx_log = error_log
    if LITELLM in args.systems:
        binary = litellm.ensure_litellm(args.litellm)
        proc, url = litellm.start_litellm(workdir, upstream_url, binary, system_cpus)
        stack.callback(proc.stop)
        running.proxies[LITELLM], running.urls[LITELLM] = proc, url
    return running


def run_load(
    args: argparse.Namespace, url: str, mode: str, concurrency: int, step: int
) -> dict[str, Any]:
    """One load-generator process; its JSON summary."""
    spec = parse_mode(mode)
    argv = [sys.executable, "-m", "benchlib.loadgen", "--url", url,
            "--concurrency", str(concurrency), "--warmup", str(_warmup(args, mode)),
            "--duration", str(_measured(args, mode)), "--max-requests", str(args.requests),
            "--turns", str(args.turns), "--step", str(step), "--seed", str(args.seed),
            "--think", str(args.think_ms / 1000)]  # fmt: skip
    argv += ["--prompt-tokens", str(spec.prompt_tokens), "--timeout", str(LOAD_TIMEOUT)]
    if spec.stream:
        argv.append("--stream")
    if spec.rate is not None:
        argv += ["--rate", str(spec.rate)]
    if spec.latency_ms is not None:
        argv += ["--latency-ms", str(spec.latency_ms)]
    if spec.fixed:
        argv += ["--latency-sigma", "0"]
    timeout = _warmup(args, mode) + _measured(args, mode) + LOAD_TIMEOUT + 60
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=BENCH_DIR,
        preexec_fn=None if spec.shared else pinned_to(args.placement.load),
    )
    if result.returncode != 0:
        raise BenchError(f"load generator failed ({result.returncode}):\n{result.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def _warmup(args: argparse.Namespace, mode: str) -> float:
    """A slow upstream needs a few of its calls before the load is steady: all workers
    start together, so the first answers come in a wave."""
    latency = parse_mode(mode).latency_ms
    return args.warmup if latency is None else max(args.warmup, 4 * latency / 1000)


def _measured(args: argparse.Namespace, mode: str) -> float:
    """A slow upstream's cell measures at least 5 of its medians: a p99 over a few hundred
    calls moves by milliseconds from run to run."""
    latency = parse_mode(mode).latency_ms
    return args.duration if latency is None else max(args.duration, 5 * latency / 1000)


def run_cell(
    args: argparse.Namespace, running: Running, where: tuple[int, str, int, str], step: int
) -> Cell:
    """Load one system at one concurrency; charge it the CPU of its recording backlog too."""
    if parse_mode(where[1]).shared and args.placement.pinned:
        run_on([running.upstream, *running.proxies.values()], None)  # all of them, every core
        try:
            return _run_cell(args, running, where, step)
        finally:
            run_on([running.upstream], args.placement.load)
            run_on(list(running.proxies.values()), args.placement.system)
    return _run_cell(args, running, where, step)


def _run_cell(
    args: argparse.Namespace, running: Running, where: tuple[int, str, int, str], step: int
) -> Cell:
    round_, mode, concurrency, system = where
    proxy = running.proxies.get(system)
    proxy_cpu = proxy.cpu_seconds() if proxy else 0.0
    upstream_cpu = running.upstream.cpu_seconds()
    busy, children, start = machine_busy_seconds(), _children_cpu(), time.monotonic()
    path = UNRECORDED_PATH if system == UNRECORDED else PATH
    load = run_load(args, running.urls[system] + path, mode, concurrency, step)
    loadgen_cpu = _children_cpu() - children
    backlog = drain_s = None
    drained = True
    if system == TRACE_PROXY and running.admin_url:
        running.proxy_calls += load["sent"]
        backlog = running.proxy_calls - int(accounted_calls(scrape(running.admin_url)))
        drain_s, drained = wait_drained(running.admin_url, running.proxy_calls, DRAIN_TIMEOUT)
    elif proxy is not None:
        settle(proxy)  # requests it still works on are its cost, not the next system's
    return Cell(
        round=round_,
        mode=mode,
        concurrency=concurrency,
        system=system,
        step=step,
        load=load,
        wall_s=time.monotonic() - start,
        proxy_cpu_s=proxy.cpu_seconds() - proxy_cpu if proxy else None,
        loadgen_cpu_s=loadgen_cpu,
        upstream_cpu_s=running.upstream.cpu_seconds() - upstream_cpu,
        machine_busy_s=machine_busy_seconds() - busy,
        drain_s=drain_s,
        drained=drained,
        backlog=backlog,
    )


def settle(proc: Proc, idle_cores: float = 0.05, window: float = 0.5) -> None:
    """Wait (at most SETTLE_TIMEOUT s) until a proxy stops working on what a cell sent it."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while time.monotonic() < deadline:
        before = proc.cpu_seconds()
        time.sleep(window)
        if proc.cpu_seconds() - before < idle_cores * window:
            return


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Budget:
    """What a whole run may spend on noise: re-runs of cells and seconds of waiting."""

    retries: int
    patience: float = QUIET_WAIT


def run_rounds(args: argparse.Namespace, running: Running) -> tuple[list[Cell], list[Cell]]:
    """Rounds x modes x concurrencies x systems, rotating which system goes first.
    Returns the kept cells (one per slot) and every attempt (what the checks must account)."""
    kept: list[Cell] = []
    every: list[Cell] = []
    budget = Budget(args.retries)
    total = args.rounds * sum(
        _runs_in(s, m, c) for m in args.modes for c in _loads(args, m) for s in args.systems
    )
    for round_ in range(1, args.rounds + 1):
        shift = (round_ - 1) % len(args.systems)
        order = args.systems[shift:] + args.systems[:shift]
        slots = [
            (m, c, s)
            for m in args.modes
            for c in _loads(args, m)
            for s in order
            if _runs_in(s, m, c)
        ]
        for mode, concurrency, system in slots:
            where = (round_, mode, concurrency, system)
            kept.append(run_slot(args, running, where, every, budget, (len(kept) + 1, total)))
    return kept, every


def _loads(args: argparse.Namespace, mode: str) -> list[int]:
    """Closed-loop modes run at each concurrency; an open-loop one once, under its cap. With a
    slow upstream, concurrency 1 measures a few calls a second: those modes run at 64 and more
    (RL rollouts keep hundreds of calls in flight)."""
    spec = parse_mode(mode)
    if spec.rate is not None:
        return [OPEN_LOOP_IN_FLIGHT]
    if spec.latency_ms is not None:
        return [c for c in args.concurrency if c >= 64] or args.concurrency
    return list(args.concurrency)


def _runs_in(system: str, mode: str, concurrency: int) -> bool:
    """LiteLLM runs only where it can answer: with 64+ requests in flight, long prompts or an
    open loop it completes none within the 30 s request timeout, and the requests it queued
    keep a core busy for minutes afterwards, which would land in the next systems' cells.
    Nor with a slow upstream: it re-creates requests, so the upstream is not asked to wait."""
    if system != LITELLM:
        return True
    spec = parse_mode(mode)
    return (
        spec.rate is None
        and spec.latency_ms is None
        and spec.prompt_tokens == PROMPT_TOKENS
        and concurrency <= 64
    )


def run_slot(
    args: argparse.Namespace,
    running: Running,
    where: tuple[int, str, int, str],
    every: list[Cell],
    budget: Budget,
    position: tuple[int, int],
) -> Cell:
    """Run one cell, again while other processes disturbed it and the budget allows; keep
    the quietest attempt."""
    attempts: list[Cell] = []
    while True:
        budget.patience -= wait_quiet(args.noise_limit, budget.patience)
        cell = run_cell(args, running, where, step=len(every) + 1)
        attempts.append(cell)
        every.append(cell)
        _progress(*position, cell, len(attempts))
        quiet = cell.other_cores <= args.noise_limit
        if quiet or budget.retries <= 0 or len(attempts) > MAX_RERUNS_PER_CELL:
            break
        budget.retries -= 1
    best = min(attempts, key=lambda c: c.other_cores)
    best.tries = len(attempts)
    return best


def wait_quiet(limit: float, patience: float) -> float:
    """Wait (at most `patience` s) until other processes use under `limit` cores, so a cell
    does not start in the middle of someone else's burst. Returns the seconds waited."""
    start = time.monotonic()
    while limit > 0 and time.monotonic() - start < patience:
        busy = machine_busy_seconds()
        time.sleep(QUIET_SAMPLE)
        if (machine_busy_seconds() - busy) / QUIET_SAMPLE < limit:
            break
    return time.monotonic() - start


def _progress(index: int, total: int, cell: Cell, attempt: int) -> None:
    load = cell.load
    drain = f", recorded {cell.drain_s:.2f} s after" if cell.drain_s is not None else ""
    problems = load["mismatched"] + sum(load["errors"].values())
    print(
        f"[{index:>2}/{total}]{'+' if attempt > 1 else ' '}round {cell.round} {cell.mode:<4} "
        f"c={cell.concurrency:<3} {cell.system:<22} {load['rps']:>6.0f} req/s  "
        f"p50 {load['p50_ms']:7.3f} ms  p99 {load['p99_ms']:7.3f} ms  "
        f"other CPU {cell.other_cores:.2f}{drain}" + (f"  PROBLEMS {problems}" if problems else ""),
        flush=True,
    )


def finish(
    args: argparse.Namespace, running: Running, cells: list[Cell], workdir: Path
) -> tuple[Checks, list[str]]:
    """Stop the proxies (trace-proxy flushes its store), then check everything recorded.
    Also returns facts worth reporting that are not pass/fail (peak memory)."""
    checks = Checks()
    check.check_bodies(cells, checks)
    check.check_waits(cells, checks)
    stats = _upstream_stats(running.urls[DIRECT])
    check.check_upstream(stats, cells, checks)
    facts = [
        f"{name} peak RSS {proc.peak_rss_mib():.0f} MiB"
        for name, proc in {"upstream": running.upstream, **running.proxies}.items()
        if name != UNRECORDED
    ]
    if TRACE_PROXY in running.proxies and running.admin_url:
        check.check_drain(cells, checks)
        samples = scrape(running.admin_url)
        code, seconds = running.proxies[TRACE_PROXY].stop()
        check.check_exit(TRACE_PROXY, code, seconds, checks)
        stream_steps = {
            c.step for c in cells if c.system == TRACE_PROXY and parse_mode(c.mode).stream
        }
        sizes = {parse_mode(mode).prompt_tokens for mode in args.modes}
        store = read_store(workdir / "store", args.turns, args.seed, stream_steps, sizes)
        for cell in cells:
            if cell.system == TRACE_PROXY:
                cell.dropped = store.dropped_by_step[cell.step]
        check.check_proxy_metrics(samples, cells, checks)
        check.check_store(store, cells, checks)
        check.check_log(TRACE_PROXY, running.proxies[TRACE_PROXY].log, checks)
    if NGINX in running.proxies:
        running.proxies[NGINX].stop()
        check.check_log(NGINX, running.nginx_log, checks, nginx=True)
    if LITELLM in running.proxies:
        running.proxies[LITELLM].stop()
    for variant in VARIANTS:
        if variant in running.proxies:
            code, seconds = running.proxies[variant].stop()
            check.check_exit(variant, code, seconds, checks)
            check.check_log(variant, running.proxies[variant].log, checks)
    running.upstream.stop()
    check.check_log("upstream", running.upstream.log, checks)
    return checks, facts


def _upstream_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/_bench/stats", timeout=5) as response:
        stats: dict[str, int] = json.loads(response.read())
    return stats


def preflight(args: argparse.Namespace) -> None:
    """Fail before starting anything if a dependency is missing."""
    if NGINX in args.systems:
        find_nginx()
    if any(s.startswith(TRACE_PROXY) for s in args.systems):
        try:
            import trace_proxy  # noqa: F401
        except ImportError:
            raise BenchError("trace_proxy is not importable: pip install -e . first") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    command = shlex.join(["python", *(sys.argv if argv is None else ["overhead.py", *argv])])
    if os.environ.get("PYTHONPATH"):  # it decides which trace_proxy is measured
        command = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {command}"
    try:
        args.placement = parse_placement(args.pin)
        preflight(args)
    except BenchError as exc:
        print(f"overhead.py: error: {exc}", file=sys.stderr)
        return 2
    environment = describe(with_nginx=NGINX in args.systems)
    if LITELLM in args.systems:
        try:
            environment["litellm"] = litellm.version(litellm.ensure_litellm(args.litellm))
        except BenchError as exc:
            print(f"overhead.py: error: {exc}", file=sys.stderr)
            return 2
    temporary = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="trace-proxy-bench-")) if temporary else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            running = start_all(args, workdir, stack)
            cells, every = run_rounds(args, running)
            checks, facts = finish(args, running, every, workdir)
    except BenchError as exc:
        print(f"overhead.py: error: {exc}\n(logs are in {workdir})", file=sys.stderr)
        return 2
    rows = aggregate(cells, args.systems)
    print("\n" + results_table(rows) + "\n\n" + "\n".join(checks.lines()))
    seconds = time.monotonic() - started
    when = datetime.now(timezone.utc)
    document = render(command, when, seconds, environment, args, rows, cells, checks, facts)
    images = plots.overhead_plots(rows, args.output.parent)
    document += (
        "\n## Plots\n\n"
        + (
            "\n".join(f"![{image.stem}]({image.name})" for image in images)
            if images
            else "(matplotlib is not installed: pip install matplotlib)"
        )
        + "\n"
    )
    args.output.write_text(document + _other_sections(args.output))
    print(f"\nwrote {args.output}")
    if temporary and checks.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not checks.ok:
        print(f"some checks failed; logs and the store are kept in {workdir}", file=sys.stderr)
    return 0 if checks.ok else 1


OTHER_SECTIONS = (
    "\n## Between runs (by hand)",
    "\n## token2text decode throughput",
    "\n## Stored volume per trajectory",
    "\n## Export backends",
    "\n## Soak: memory under sustained load",
    "\n## Recording cost: two versions side by side",
)


def _other_sections(path: Path) -> str:
    """The other benchmarks' sections of RESULTS.md, kept when this one is rewritten."""
    if not path.exists():
        return ""
    text = path.read_text()
    starts = [i for i in (text.find(h) for h in OTHER_SECTIONS) if i >= 0]
    return "\n" + text[min(starts) :].lstrip("\n") if starts else ""


if __name__ == "__main__":
    sys.exit(main())
