"""Memory over a long run: does trace-proxy's resident memory stay flat under sustained load?

    python benchmarks/soak.py [--minutes 10] [--concurrency 16] [--every 5]

Starts the benchmark upstream and a trace-proxy recording every call (jsonl, from its export
process), drives it with the closed-loop load generator for the whole time, and samples the
resident memory (VmRSS) of the forwarding process and of its helper processes (capture,
export) every few seconds.
Writes `benchmarks/soak-rss.png` (needs matplotlib) and replaces the "## Soak" section of
RESULTS.md. Flat means: the last minute's median within 10% of the median of the second minute
(the first one is warm-up: imports, pools and caches fill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib.procs import (  # noqa: E402
    Proc,
    child_env,
    start_trace_proxy,
    start_upstream,
    stop_on_sigterm,
)
from benchlib.recording import scrape, total  # noqa: E402

SECTION = "## Soak: memory under sustained load"
LIMIT_MIB = 300
FLAT_WITHIN = 0.10


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


Sample = tuple[float, float, float]  # seconds, proxy MiB, helper processes MiB


def sample(proxy: Proc, stop: threading.Event, every: float, out: list[Sample]) -> None:
    start = time.monotonic()
    while not stop.wait(every if out else 0):
        main, *children = proxy.pids()
        out.append((time.monotonic() - start, rss_mib(main), sum(map(rss_mib, children))))


def medians(samples: list[Sample]) -> tuple[float, float, float]:
    """Median MiB of the proxy, its helper processes and all."""
    return (
        statistics.median(s[1] for s in samples),
        statistics.median(s[2] for s in samples),
        statistics.median(s[1] + s[2] for s in samples),
    )


def plot(samples: list[Sample], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    minutes = [s[0] / 60 for s in samples]
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.plot(minutes, [s[1] for s in samples], label="forwarding process")
    axes.plot(minutes, [s[2] for s in samples], label="capture + export processes")
    axes.plot(minutes, [s[1] + s[2] for s in samples], label="all")
    axes.axhline(LIMIT_MIB, color="grey", linestyle="--", label=f"target < {LIMIT_MIB} MB")
    axes.set_xlabel("minutes under load")
    axes.set_ylabel("resident memory, MiB")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="closed loop: workers; open loop: the cap on requests in flight",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop at this many requests/s (default: closed loop)",
    )
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "RESULTS.md")
    args = parser.parse_args()
    stop_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="trace-proxy-soak-"))
    upstream, upstream_url = start_upstream(work, 4, 1)
    proxy, url, admin = start_trace_proxy(work, upstream_url)
    samples: list[Sample] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(proxy, stop, args.every, samples))
    sampler.start()
    seconds = args.minutes * 60
    argv = [sys.executable, "-m", "benchlib.loadgen", "--url", url + "/v1/completions",
            "--concurrency", str(args.concurrency), "--duration", str(seconds),
            "--warmup", "0", "--max-requests", "100000000"]  # fmt: skip
    if args.rate is not None:
        argv += ["--rate", str(args.rate)]
    try:
        done = subprocess.run(argv, cwd=BENCH_DIR, env=child_env(), capture_output=True,
                              text=True, timeout=seconds + 300)  # fmt: skip
    finally:
        stop.set()
        sampler.join()
    load = json.loads(done.stdout.strip().splitlines()[-1])
    metrics = scrape(admin)
    proxy.stop()
    upstream.stop()
    both = [s[1] + s[2] for s in samples]
    warm = [s for s in samples if 60 <= s[0] < 120] or samples
    last = [s for s in samples if s[0] >= samples[-1][0] - 60]
    early, late = medians(warm), medians(last)
    growth = (late[2] - early[2]) / early[2]
    flat = abs(growth) <= FLAT_WITHIN and max(both) < LIMIT_MIB
    target = f"(< {LIMIT_MIB} MB, within {FLAT_WITHIN:.0%})"
    verdict = f"flat and under the target {target}." if flat else f"NOT flat or over {target}."
    image = args.output.parent / "soak-rss.png"
    load_text = f"{args.rate:g} requests/s" if args.rate else f"concurrency {args.concurrency}"
    title = f"trace-proxy RSS, {args.minutes:g} min at {load_text}"
    plotted = plot(samples, image, title)
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    section = [
        SECTION,
        "",
        f"`{command.strip()}`: {load['sent']:,} requests ({load['rps']:,.0f}/s, "
        f"{sum(load['errors'].values())} errors, {load['mismatched']} bodies differing), "
        f"{total(metrics, 'trace_proxy_calls_recorded_total'):,.0f} calls recorded, "
        f"{total(metrics, 'trace_proxy_capture_dropped_total'):,.0f} capture drops, "
        f"{total(metrics, 'trace_proxy_export_dropped_total'):,.0f} export drops.",
        "",
        "| | forwarding process | capture + export processes | all |",
        "|---|---|---|---|",
        "| after 1-2 min (median) | {:.0f} MiB | {:.0f} MiB | {:.0f} MiB |".format(*early),
        "| last minute (median) | {:.0f} MiB | {:.0f} MiB | {:.0f} MiB |".format(*late),
        f"| peak | {max(s[1] for s in samples):.0f} MiB | {max(s[2] for s in samples):.0f} MiB "
        f"| {max(both):.0f} MiB |",
        "",
        f"Growth from the second minute to the last: {growth:+.1%}; " + verdict,
    ]
    if plotted:
        section += ["", f"![RSS over time]({image.name})"]
    text = args.output.read_text() if args.output.exists() else ""
    start = text.find(SECTION)
    if start >= 0:
        after = text.find("\n## ", start + len(SECTION))
        text = text[:start].rstrip("\n") + ("\n\n" + text[after + 1 :] if after >= 0 else "")
    args.output.write_text(text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n")
    print("\n".join(section))
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
