"""What recording costs, process by process: this checkout against an earlier revision, in one run.

    python benchmarks/recording_cost.py --baseline REV [--cells json:64,json-8k:64,json-32k:1]
                                        [--rounds 2] [--duration 6] [--rollouts N]
                                        [--proxy-args '--max-samples-per-step 4']

The machine's speed drifts by tens of percent between runs (the overhead benchmark's
forwarding-only figures moved that much with no change to forwarding), so a change to recording
is measured against its baseline side by side: both versions, started from the same Python
environment (the baseline from a `git worktree` of REV put first on PYTHONPATH), take turns on
the same cells, round after round, in alternating order.

For each run of a cell: a fresh trace-proxy recording every call to jsonl, the closed-loop load
generator for `--duration` seconds, then a wait until every call is parsed and every closed
trajectory written, so a backlog is charged to the version that left it. CPU is read from /proc
per process: forwarding, capture and export. The fair figure is CPU per *recorded* call: a
version that falls behind drops exchanges (counted in `capture_dropped`) and spends nothing on
them, which lowers its CPU per request sent without making it cheaper.

Writes the section "## Recording cost" of RESULTS.md (`--output`) and prints it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib.procs import (  # noqa: E402
    BenchError,
    Proc,
    child_env,
    cpu_seconds,
    peak_rss_kib,
    start_trace_proxy,
    start_upstream,
    stop_on_sigterm,
)
from benchlib.recording import scrape, total, wait_drained  # noqa: E402
from benchlib.workload import PATH, parse_mode  # noqa: E402

SECTION = "## Recording cost: two versions side by side"


@dataclass
class Run:
    version: str
    cell: str
    sent: int
    rps: float
    cpu: tuple[float, float, float]  # seconds per process, load and drain
    recorded: float
    dropped: float
    peak_rss: tuple[float, float, float]  # MiB, by process

    def per_request(self, index: int) -> float:
        return self.cpu[index] / self.sent * 1e6

    @property
    def per_recorded(self) -> float:
        """Capture and export CPU per recorded call, in µs."""
        return (self.cpu[1] + self.cpu[2]) / max(self.recorded, 1) * 1e6


def cpu_by_process(proc: Proc) -> tuple[float, float, float]:
    pids = proc.pids()  # forwarding, capture, export (parents before children; all are up
    # once /ready says so: `start_trace_proxy` waits for it)
    if len(pids) != 3:
        raise BenchError(f"{proc.name}: expected 3 processes, found {len(pids)}")
    first, second, third = (cpu_seconds(pid) for pid in pids)
    return first, second, third


def peak_rss_by_process(proc: Proc) -> tuple[float, float, float]:
    first, second, third = (peak_rss_kib(pid) / 1024 for pid in proc.pids())
    return first, second, third


def run_once(
    args: argparse.Namespace, workdir: Path, upstream: str, version: str, tree: Path | None,
    cell: str, number: int,
) -> Run:  # fmt: skip
    mode_name, _, concurrency = cell.partition(":")
    mode = parse_mode(mode_name)
    name = f"{version}-{number}"
    extra = shlex.split(args.proxy_args)
    proxy, url, admin = start_trace_proxy(workdir, upstream, name, extra, source=tree)
    try:
        before = cpu_by_process(proxy)
        argv = [sys.executable, "-m", "benchlib.loadgen", "--url", url + PATH,
                "--concurrency", concurrency, "--warmup", "0", "--duration", str(args.duration),
                "--prompt-tokens", str(mode.prompt_tokens),
                "--rollouts", str(args.rollouts)]  # fmt: skip
        if mode.stream:
            argv.append("--stream")
        if mode.rate is not None:
            argv += ["--rate", str(mode.rate)]
        if mode.latency_ms is not None:
            argv += ["--latency-ms", str(mode.latency_ms)]
        done = subprocess.run(argv, cwd=BENCH_DIR, env=child_env(), capture_output=True,
                              text=True, timeout=args.duration + 120)  # fmt: skip
        if done.returncode != 0:
            raise BenchError(f"load generator failed:\n{done.stderr[-2000:]}")
        load: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        _, drained = wait_drained(admin, int(load["sent"]), timeout=300)
        if not drained:
            raise BenchError(f"{proxy.name} did not finish recording within 300 s")
        after = cpu_by_process(proxy)
        metrics = scrape(admin)
        peak_rss = peak_rss_by_process(proxy)
    finally:
        proxy.stop()
    return Run(
        version=version,
        cell=cell,
        sent=int(load["sent"]),
        rps=float(load["rps"]),
        cpu=(after[0] - before[0], after[1] - before[1], after[2] - before[2]),
        recorded=total(metrics, "trace_proxy_calls_recorded_total"),
        dropped=total(metrics, "trace_proxy_capture_dropped_total"),
        peak_rss=peak_rss,
    )


def report(args: argparse.Namespace, runs: list[Run], head: str, base: str) -> str:
    lines = [
        SECTION, "",
        f"`python benchmarks/recording_cost.py --baseline {args.baseline} --cells "
        f"{','.join(args.cells)} --rounds {args.rounds} --duration {args.duration:g}"
        + (f" --rollouts {args.rollouts}" if args.rollouts > 1 else "")
        + (f" --proxy-args '{args.proxy_args}'" if args.proxy_args else "")
        + "`: "
        f"{head} against {base}, medians of {args.rounds} runs each, the two versions "
        "alternating. CPU is per request sent (µs) by process, and capture + export per call "
        "recorded; a version that drops exchanges (falls behind) spends nothing on them. Peak RSS: "
        "the highest resident memory of the capture process, and of the three added up.", "",
        "| cell | version | req/s | forwarding | capture | export | all | calls recorded "
        "| dropped | capture + export per recorded call | peak RSS capture | peak RSS all |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for cell in args.cells:
        per_version = {}
        for version in (base, head):
            mine = [r for r in runs if r.cell == cell and r.version == version]
            med = statistics.median
            values = [med(r.per_request(i) for r in mine) for i in range(3)]
            recorded = med(r.recorded / r.sent for r in mine)
            per_version[version] = med(r.per_recorded for r in mine)
            lines.append(
                f"| {cell} | {version} | {med(r.rps for r in mine):.0f} | {values[0]:.0f} "
                f"| {values[1]:.0f} | {values[2]:.0f} | {sum(values):.0f} | {recorded:.1%} "
                f"| {med(r.dropped for r in mine):.0f} | {per_version[version]:.0f} "
                f"| {med(r.peak_rss[1] for r in mine):.0f} MiB "
                f"| {med(sum(r.peak_rss) for r in mine):.0f} MiB |"
            )
        change = per_version[head] / per_version[base] - 1
        lines.append(f"| {cell} | change | | | | | | | | {change:+.0%} | | |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace (or append) this section of RESULTS.md, keeping every other one."""
    text = path.read_text() if path.exists() else ""
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    path.write_text(text)


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=BENCH_DIR, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--cells", type=lambda v: v.split(","),
                        default=["json:64", "json-8k:64", "json-32k:1"],
                        help="MODE:CONCURRENCY, comma-separated")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of load per run")
    parser.add_argument("--rollouts", type=int, default=1,
                        help="trajectories per sample index, as GRPO sends them")  # fmt: skip
    parser.add_argument("--proxy-args", default="",
                        help="more trace-proxy options for both versions, e.g. "
                        "'--max-samples-per-step 4'")  # fmt: skip
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "RESULTS.md")
    args = parser.parse_args()
    stop_on_sigterm()
    head = git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain",
                                                                      "--", "../trace_proxy")
                                                  else "")  # fmt: skip
    base = git("rev-parse", "--short", args.baseline)
    workdir = Path(tempfile.mkdtemp(prefix="trace-proxy-cost-"))
    tree = workdir / "baseline"
    git("worktree", "add", "--detach", str(tree), args.baseline)
    sizes = sorted({parse_mode(cell.partition(":")[0]).prompt_tokens for cell in args.cells})
    upstream, upstream_url = start_upstream(workdir, 4, 1, prompt_sizes=sizes)
    runs: list[Run] = []
    try:
        number = 0
        for round_ in range(args.rounds):
            for cell in args.cells:
                order = [(base, tree), (head, None)]
                for version, source in order if round_ % 2 == 0 else order[::-1]:
                    number += 1
                    run = run_once(args, workdir, upstream_url, version, source, cell, number)
                    runs.append(run)
                    print(f"round {round_ + 1} {cell:12} {version:16} {run.rps:7.0f} req/s  "
                          f"µs/request {[round(run.per_request(i)) for i in range(3)]}  "
                          f"recorded {run.recorded:.0f}/{run.sent}  "
                          f"per recorded call {run.per_recorded:.0f} µs  "
                          f"peak RSS MiB {[round(m) for m in run.peak_rss]}",
                          flush=True)  # fmt: skip
    except BenchError as exc:
        print(f"recording_cost: {exc}", file=sys.stderr)
        return 2
    finally:
        upstream.stop()
        git("worktree", "remove", "--force", str(tree))
    section = report(args, runs, head, base)
    write_section(args.output, section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
