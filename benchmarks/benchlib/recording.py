"""What trace-proxy recorded: its Prometheus counters while running, its jsonl store afterwards.

The benchmark waits for the proxy's recording backlog to drain after each of its cells, so its
background work is charged to it and not to whichever system runs next; the time that takes is
reported. After the run, the store is read back and compared with what the load generator sent.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchlib.procs import BenchError
from benchlib.workload import build_turns

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(admin_url: str) -> dict[str, float]:
    """The proxy's /metrics as {'name{labels}': value}."""
    try:
        with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError as exc:
        raise BenchError(f"trace-proxy's admin endpoint stopped answering: {exc}") from None
    samples = {}
    for line in text.splitlines():
        if match := _SAMPLE.match(line):
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def total(samples: dict[str, float], name: str, label: str = "") -> float:
    """Sum of a metric over its labels (optionally only samples whose labels contain `label`)."""
    return sum(
        value
        for key, value in samples.items()
        if key.partition("{")[0] == name and label in key.partition("{")[2]
    )


def accounted_calls(samples: dict[str, float]) -> float:
    """Generate exchanges the capture stage has finished with: recorded, unparsed or dropped."""
    return (
        total(samples, "trace_proxy_calls_recorded_total")
        + total(samples, "trace_proxy_calls_unparsed_total")
        + total(samples, "trace_proxy_capture_dropped_total")
    )


def _drained(samples: dict[str, float], expected_calls: int) -> bool:
    closed = total(samples, "trace_proxy_trajectories_closed_total")
    exported = total(samples, "trace_proxy_exported_records_total")
    dropped = total(samples, "trace_proxy_export_dropped_total")
    return (
        accounted_calls(samples) >= expected_calls
        and exported + dropped >= closed
        and total(samples, "trace_proxy_export_queue") == 0
    )


def wait_drained(admin_url: str, expected_calls: int, timeout: float) -> tuple[float, bool]:
    """Wait until every call sent so far is parsed and every closed trajectory written."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _drained(scrape(admin_url), expected_calls):
            return time.monotonic() - start, True
        time.sleep(0.02)
    return time.monotonic() - start, False


@dataclass
class StoreReport:
    files: int = 0
    trajectories: int = 0
    calls: int = 0
    calls_dropped: int = 0  # counted in their trajectories' summaries, not recorded
    calls_by_step: Counter[int] = field(default_factory=Counter)
    dropped_by_step: Counter[int] = field(default_factory=Counter)
    trajectories_by_step: Counter[int] = field(default_factory=Counter)
    close_reasons: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    unparsed: int = 0
    later_parts: int = 0
    stream_flag_wrong: int = 0
    token_mismatches: int = 0
    mismatch_sample: str | None = None


def read_store(
    store: Path, turns: int, seed: int, stream_steps: set[int], sizes: set[int]
) -> StoreReport:
    """Count trajectories and calls per step and check every recorded call's token ids
    against the canned turn with the same prompt length (each turn's is distinct), so a turn
    whose capture was dropped does not shift the later ones."""
    expected = {
        len(prompt): (prompt, output)
        for size in sizes
        for prompt, output in zip(*_expected_tokens(turns, seed, size), strict=True)
    }
    report = StoreReport()
    for path in sorted(store.rglob("*.jsonl")):
        if path.name == "events.jsonl":
            continue
        report.files += 1
        with path.open("rb") as lines:
            for line in lines:
                record = orjson.loads(line)
                if record.get("record") == "trajectory":  # not step summaries or annotations
                    _check_trajectory(record, expected, stream_steps, report)
    return report


def _expected_tokens(turns: int, seed: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    canned = build_turns(turns, stream=False, seed=seed, prompt_tokens=size)
    prompts = [orjson.loads(t.request)["prompt"] for t in canned]
    outputs = [orjson.loads(t.response)["choices"][0]["token_ids"] for t in canned]
    return prompts, outputs


def _check_trajectory(
    record: dict[str, Any],
    expected: dict[int, tuple[list[int], list[int]]],
    stream_steps: set[int],
    report: StoreReport,
) -> None:
    from trace_proxy.trajectories.prompts import expand_prompts

    step = record["key"]["step"]
    calls = record["calls"]
    report.trajectories += 1
    report.trajectories_by_step[step] += 1
    dropped = record["summary"].get("calls_dropped", 0)
    report.calls += len(calls)
    report.calls_dropped += dropped
    report.dropped_by_step[step] += dropped
    report.calls_by_step[step] += len(calls) + dropped
    report.close_reasons[record["close_reason"]] += 1
    report.later_parts += record["part"] > 1
    full = expand_prompts(record)
    for index, call in enumerate(calls):
        report.errors += call["error"] is not None
        report.unparsed += call["unparsed"] is not None
        report.stream_flag_wrong += call["stream"] != (step in stream_steps)
        prompt = full[index].get("token_ids")
        got = (prompt, (call["outputs"] or [{}])[0].get("token_ids"))
        if got != expected.get(len(prompt or ()), ()):
            report.token_mismatches += 1
            report.mismatch_sample = report.mismatch_sample or (
                f"step {step} sample {record['key']['sample_index']} call {index}"
            )
