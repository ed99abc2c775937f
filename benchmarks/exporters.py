"""Export cost: trajectories per second per backend, and what exporting does to the proxy.

Part 1 exports the same realistic trajectories (recorded by a real proxy from the simulated vLLM
server: multi-turn chat with tool calls) through each backend's exporter, in this process, as
the pipeline's worker thread would, and reports trajectories/s.

Part 2 runs the same closed-loop load (benchlib's load generator, its own process; 4-turn
rollouts of 1k-token prompts) directly, through a trace-proxy exporting to jsonl only, through
one exporting to jsonl, mlflow (sqlite), trackio and otlp (to a local sink) at once from its
export process (the default), and through the same with the exporters inline in the proxy's
process; rounds alternate, and the latency the client sees in each is reported.

    python benchmarks/exporters.py [--duration 4] [--rounds 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib.procs import spawn, start_upstream, wait_for_line  # noqa: E402

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that accepts everything: the backend's far end, at no cost."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def start_sink() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


async def record_trajectories(count: int) -> list[Any]:
    """Real records: a proxy in front of the simulated vLLM, a tool-calling chat agent."""
    from openai import AsyncOpenAI

    from trace_proxy.config import Settings
    from trace_proxy.demo.run import rollout
    from trace_proxy.demo.simulated_vllm import SimulatedVLLM
    from trace_proxy.demo.tokenizer import load_qwen_tokenizer
    from trace_proxy.exporters.base import Exporter
    from trace_proxy.proxy.service import ProxyService
    from trace_proxy.trajectories.record import Record, Trajectory

    kept: list[Record] = []

    class Keep(Exporter):
        name = "keep"

        def export(self, records: list[Record]) -> None:
            kept.extend(r for r in records if isinstance(r, Trajectory))

        def close(self) -> None:
            pass

    tokenizer = await asyncio.to_thread(load_qwen_tokenizer)
    simulator = SimulatedVLLM(tokenizer=tokenizer, model="qwen-sim", deterministic=True)
    runner, upstream = await simulator.start()
    settings = Settings(upstream=[upstream], port=0, admin_port=0, step_close_grace=0.0)
    async with ProxyService(settings, exporters=[Keep()]) as service:
        assert service.addresses is not None
        client = AsyncOpenAI(base_url=service.addresses.proxy + "/v1", api_key="x")
        await asyncio.gather(
            *(rollout(client, "qwen-sim", 1, i, 0, stream=False) for i in range(count))
        )
        await client.close()
    await runner.cleanup()
    return kept


def exporter_throughput(records: list[Any], work: Path, sink: str) -> list[tuple[str, float, int]]:
    from trace_proxy.exporters.backends.jsonl import JsonlExporter
    from trace_proxy.exporters.backends.mlflow import MlflowExporter
    from trace_proxy.exporters.backends.otlp import OtlpExporter
    from trace_proxy.exporters.backends.trackio import TrackioExporter

    backends: list[tuple[str, Any]] = [
        ("jsonl", lambda: JsonlExporter(work / "jsonl")),
        ("mlflow (sqlite)", lambda: MlflowExporter(f"sqlite:///{work}/mlflow.db", "bench", None)),
        ("trackio", lambda: TrackioExporter("bench", work / "trackio")),
        ("otlp", lambda: OtlpExporter(sink, {})),
    ]
    results = []
    for name, make in backends:
        exporter = make()
        exporter.export(records[:4])  # warm up (imports, schema creation, first run)
        started = time.perf_counter()
        for start in range(0, len(records), 64):
            exporter.export(records[start : start + 64])
        exporter.close()
        results.append((name, len(records) / (time.perf_counter() - started), len(records)))
    return results


def load(url: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "benchlib.loadgen", "--url", url + "/v1/completions",
            "--concurrency", str(args.concurrency), "--duration", str(args.duration),
            "--warmup", "1"]  # fmt: skip
    done = subprocess.run(argv, cwd=BENCH_DIR, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def start_proxy(upstream: str, work: Path, name: str, extra: list[str]) -> tuple[Any, str, str]:
    argv = [sys.executable, "-m", "trace_proxy", "serve", "--upstream", upstream, "--port", "0",
            "--admin-port", "0", "--output", str(work / name), *extra]  # fmt: skip
    proc = spawn(name, argv, work)
    line = r"trace-proxy: forwarding (\S+) ->.*metrics at (\S+)/metrics"
    match = wait_for_line(proc, line, timeout=120)
    return proc, match.group(1), match.group(2)


def export_counts(admin: str) -> dict[str, dict[str, float]]:
    """Per backend: records exported and dropped (any reason), from the proxy's /metrics."""
    import urllib.request

    with urllib.request.urlopen(admin + "/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for metric, what in (("trace_proxy_exported_records_total", "exported"),
                             ("trace_proxy_export_dropped_total", "dropped")):  # fmt: skip
            if line.startswith(metric + "{"):
                backend = line.split('backend="', 1)[1].split('"', 1)[0]
                slot = counts.setdefault(backend, {"exported": 0.0, "dropped": 0.0})
                slot[what] += float(line.rsplit(" ", 1)[1])
    return counts


def latency_under_export(
    args: argparse.Namespace, work: Path, sink: str
) -> tuple[dict[str, list[Any]], dict[str, dict[str, dict[str, float]]]]:
    """Each round runs every system in turn; each proxy runs only during its own load (a fresh
    one per round, stopped without waiting for its backlog), so no system's export work spills
    into another's measurement."""
    upstream_proc, upstream = start_upstream(work, 4, 1)
    all_backends = [
        "--backend", "jsonl,mlflow,trackio,otlp", "--otlp-endpoint", sink,
        "--mlflow-tracking-uri", f"sqlite:///{work}/mlflow-proxy.db",
    ]  # fmt: skip
    systems = {
        "jsonl only": [],
        "all four, export process": all_backends,
        "all four, inline (--export-mode inline)": [*all_backends, "--export-mode", "inline"],
    }
    runs: dict[str, list[Any]] = {name: [] for name in ["direct", *systems]}
    counts: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for round_ in range(args.rounds):
            runs["direct"].append(load(upstream, args, work))
            for index, (name, extra) in enumerate(systems.items()):
                label = f"proxy-{round_}-{index}"
                trackio = ["--trackio-dir", str(work / label / "trackio")] if extra else []
                proc, url, admin = start_proxy(
                    upstream, work, label, [*extra, *trackio, "--shutdown-grace", "1"]
                )
                try:
                    runs[name].append(load(url, args, work))
                    counts[name] = export_counts(admin)  # the last round's
                finally:
                    proc.stop()
    finally:
        upstream_proc.stop()
    return runs, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trajectories", type=int, default=200)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trace-proxy-exporters-"))
    sink_server, sink = start_sink()
    started = time.monotonic()
    records = asyncio.run(record_trajectories(args.trajectories))
    throughput = exporter_throughput(records, work, sink)
    runs, counts = latency_under_export(args, work, sink)
    sink_server.shutdown()
    command = "python benchmarks/exporters.py " + " ".join(sys.argv[1:])
    calls = sum(len(r.calls) for r in records) / max(1, len(records))
    tools = sum(len(r.tools) for r in records) / max(1, len(records))
    print(f"`{command.strip()}` ({time.monotonic() - started:.0f} s, {os.cpu_count()} cores)\n")
    print(f"Part 1: {len(records)} trajectories ({calls:.1f} calls, {tools:.1f} tool spans each)\n")
    print("| backend | trajectories/s |\n|---|---|")
    for name, rate, _ in throughput:
        print(f"| {name} | {rate:,.0f} |")
    print(f"\nPart 2: concurrency {args.concurrency}, {args.duration} s x {args.rounds} rounds, "
          "medians of rounds\n")  # fmt: skip
    print("| system | p50 ms | p99 ms | req/s | errors |\n|---|---|---|---|---|")
    for name, results in runs.items():
        p50 = statistics.median(r["p50_ms"] for r in results)
        p99 = statistics.median(r["p99_ms"] for r in results)
        rps = statistics.median(r["rps"] for r in results)
        errors = sum(sum(r["errors"].values()) for r in results)
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {rps:,.0f} | {errors} |")
    print("\nRecords each backend had exported and dropped by the end of the last round's load "
          "(the rest were still in the spool)\n")  # fmt: skip
    print("| proxy | backend | exported | dropped |\n|---|---|---|---|")
    for name, by_backend in counts.items():
        for backend, c in sorted(by_backend.items()):
            print(f"| {name} | {backend} | {c['exported']:,.0f} | {c['dropped']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
