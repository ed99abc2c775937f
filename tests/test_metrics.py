"""Metrics relayed from helper processes: what a killed helper counted is kept when another
replaces it, and what several processes report adds up on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trace_proxy.metrics import RelayedMetrics, exposition


def helper_text(exported: int, queue: int, latencies: list[float]) -> str:
    """What a helper process sends: its own registry in the text format."""
    registry = CollectorRegistry()
    Counter("t_exported", "records", ["backend"], registry=registry).labels("jsonl").inc(exported)
    Gauge("t_queue", "queued", registry=registry).set(queue)
    histogram = Histogram("t_seconds", "time", buckets=(0.1, 1.0), registry=registry)
    for latency in latencies:
        histogram.observe(latency)
    return generate_latest(registry).decode()


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = exposition(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_replaced_helper_keeps_its_counts_but_not_its_state() -> None:
    registry = CollectorRegistry()
    relayed = RelayedMetrics()
    registry.register(relayed)
    relayed.text = helper_text(exported=7, queue=3, latencies=[0.05, 0.5])
    relayed.retire()  # killed; its successor has not reported yet
    seen = samples(registry)
    assert seen[("t_exported_total", (("backend", "jsonl"),))] == 7
    assert ("t_queue", ()) not in seen  # the dead process's queue is gone with it
    relayed.text = helper_text(exported=2, queue=1, latencies=[2.0])
    seen = samples(registry)
    assert seen[("t_exported_total", (("backend", "jsonl"),))] == 9
    assert seen[("t_queue", ())] == 1
    assert seen[("t_seconds_count", ())] == 3
    assert seen[("t_seconds_bucket", (("le", "0.1"),))] == 1
    assert seen[("t_seconds_bucket", (("le", "+Inf"),))] == 3
    relayed.retire()  # and the second one dies too
    relayed.text = helper_text(exported=1, queue=0, latencies=[])
    assert samples(registry)[("t_exported_total", (("backend", "jsonl"),))] == 10


def test_each_family_appears_once_on_the_merged_page() -> None:
    registry = CollectorRegistry()
    first, second = RelayedMetrics(), RelayedMetrics()
    registry.register(first)
    registry.register(second)
    first.text = helper_text(exported=4, queue=2, latencies=[])
    first.retire()
    first.text = helper_text(exported=1, queue=2, latencies=[])
    second.text = helper_text(exported=5, queue=1, latencies=[])
    page = exposition(registry).decode()
    assert page.count("# TYPE t_exported_total counter") == 1
    assert samples(registry)[("t_exported_total", (("backend", "jsonl"),))] == 10
    assert samples(registry)[("t_queue", ())] == 3
