"""Prometheus metrics of one proxy, in its own registry (no process-global state).

`Metrics` belongs to the forwarding process and to the capture process (each fills in its
part; the spool's backlog is the part of whichever writes the spool); `ExportMetrics` to
whichever process exports. Helper processes send their samples to
the process above them, which relays them; `exposition` merges what several report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# `_created` series say when a process made a counter: noise on a dashboard, and they cannot
# be merged across the processes whose samples /metrics relays.
disable_created_metrics()  # type: ignore[no-untyped-call]


LabelledMetric = TypeVar("LabelledMetric", bound=MetricWrapperBase)


def children(metric: LabelledMetric) -> Callable[..., LabelledMetric]:
    """`metric.labels`, remembered per label values: `labels()` takes a lock and builds its key
    on every call, which adds up per request. Only for labels with a small set of values."""
    found: dict[tuple[str, ...], LabelledMetric] = {}

    def child(*values: str) -> LabelledMetric:
        known = found.get(values)
        if known is None:
            known = found[values] = metric.labels(*values)
        return known

    return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "trace_proxy_requests",
            "Requests forwarded, by route kind and status class",
            ["kind", "status"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "trace_proxy_upstream_errors",
            "Requests the upstream could not serve, by cause",
            ["upstream", "cause"],
            registry=r,
        )
        self.in_flight = Gauge(
            "trace_proxy_in_flight",
            "Requests in flight per upstream",
            ["upstream"],
            registry=r,
        )
        self.client_rejected = Counter(
            "trace_proxy_client_rejected",
            "Requests refused or cut off because of the client, by reason (header_timeout and "
            "body_timeout: 408; header_too_large: 431; bad_request: 400); none of them reached an "
            "upstream whole",
            ["reason"],
            registry=r,
        )
        self.admin_rejected = Counter(
            "trace_proxy_admin_rejected",
            "Requests to the admin port refused because of the client, by reason (as "
            "trace_proxy_client_rejected counts them on the proxy port)",
            ["reason"],
            registry=r,
        )
        self.added_latency = Histogram(
            "trace_proxy_response_start_seconds",
            "Time from request received to response headers sent to the client",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            registry=r,
        )
        self.capture_dropped = Counter(
            "trace_proxy_capture_dropped",
            "Exchanges not recorded, by reason",
            ["reason"],
            registry=r,
        )
        self.capture_skipped_bodies = Counter(
            "trace_proxy_capture_skipped_bodies",
            "Exchanges recorded without their bodies, by reason (body_too_large: over "
            "--capture-max-body); their calls are recorded as unparsed",
            ["reason"],
            registry=r,
        )
        self.calls_recorded = Counter(
            "trace_proxy_calls_recorded",
            "Generate calls recorded, by dialect",
            ["dialect"],
            registry=r,
        )
        self.calls_unparsed = Counter(
            "trace_proxy_calls_unparsed",
            "Generate calls recorded as unparsed, by dialect",
            ["dialect"],
            registry=r,
        )
        self.tool_calls_recorded = Counter(
            "trace_proxy_tool_calls_recorded",
            "Tool-server calls recorded, by route",
            ["route"],
            registry=r,
        )
        self.events_recorded = Counter(
            "trace_proxy_step_events",
            "Step events recorded, by event",
            ["event"],
            registry=r,
        )
        self.trajectories_closed = Counter(
            "trace_proxy_trajectories_closed",
            "Trajectories closed, by reason",
            ["reason"],
            registry=r,
        )
        self.rewards = Counter(
            "trace_proxy_rewards",
            "Rewards posted, by where the trajectory was (open, waiting, exported, unknown)",
            ["where"],
            registry=r,
        )
        self.sampled = Counter(
            "trace_proxy_sampled",
            "Calls and trajectories seen, kept and dropped by the sampler (dropped for other "
            "reasons: trace_proxy_capture_dropped, trace_proxy_export_dropped); late: of those "
            "seen, the ones that arrived after their step's summary was written",
            ["what", "outcome"],
            registry=r,
        )
        self.sampler_dropped = Counter(
            "trace_proxy_sampler_dropped",
            "Calls and trajectories not kept, by reason "
            "(sampler: not selected; waiting_full: over the bound of waiting candidates)",
            ["what", "reason"],
            registry=r,
        )
        self.inference_decoder_waits = Counter(
            "trace_proxy_inference_decoder_waits",
            "Calls that waited for the tokenizer to load (--tokenizer) before being placed, "
            "since only decoding their new ids could tell which rollout they continue; by "
            "outcome (decoded; no_decoder: it did not load in time, or has no decoder for the "
            "model, and the call starts a trajectory marked inferred:ambiguous)",
            ["outcome"],
            registry=r,
        )
        self.inference_evicted = Counter(
            "trace_proxy_inference_evicted",
            "Contexts of keyless trajectories forgotten to bound memory (a later continuation "
            "then starts a new trajectory)",
            registry=r,
        )
        self.open_trajectories = Gauge(
            "trace_proxy_open_trajectories",
            "Trajectories still collecting calls",
            registry=r,
        )
        self.capture_queue = Gauge(
            "trace_proxy_capture_queue",
            "Exchanges waiting to be parsed",
            registry=r,
        )
        self.capture_overflowed = Counter(
            "trace_proxy_capture_overflowed",
            "Exchanges that waited on disk to be parsed, the capture queue being full",
            registry=r,
        )
        self.capture_overflow_bytes = Gauge(
            "trace_proxy_capture_overflow_bytes",
            "Bytes on disk of exchanges waiting there to be parsed (capture process)",
            registry=r,
        )
        self.spool_dropped = Counter(
            "trace_proxy_spool_dropped",
            "Records that never reached the spool, by reason (queue_full: the memory queue in "
            "front of the spool was full; spool_error: the disk refused them; unencodable: "
            "not writable as JSON)",
            ["reason"],
            registry=r,
        )
        self.spool_bytes = Gauge(
            "trace_proxy_spool_bytes",
            "Bytes of records on disk in the spool (exported by some backends, not all)",
            registry=r,
        )
        self.export_queue = Gauge(
            "trace_proxy_export_queue",
            "Records in the spool a backend has not exported yet, by its cursor (also while the "
            "export process is starting or down)",
            ["backend"],
            registry=r,
        )
        self.capture_process_restarts = Counter(
            "trace_proxy_capture_process_restarts",
            "Times the capture process ended unexpectedly and was started again",
            registry=r,
        )
        self.export_process_restarts = Counter(
            "trace_proxy_export_process_restarts",
            "Times the export process ended unexpectedly and was started again",
            registry=r,
        )


class ExportMetrics:
    """Per-backend accounting of the exporters: exported, retried, dropped, lag, health."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.exported = Counter(
            "trace_proxy_exported_records",
            "Records exported, by backend",
            ["backend"],
            registry=r,
        )
        self.export_retries = Counter(
            "trace_proxy_export_retries",
            "Export attempts retried, by backend",
            ["backend"],
            registry=r,
        )
        self.export_dropped = Counter(
            "trace_proxy_export_dropped",
            "Records not exported, by backend and reason",
            ["backend", "reason"],
            registry=r,
        )
        self.processing_errors = Counter(
            "trace_proxy_processing_errors",
            "Batches a processor failed on (exported as is)",
            ["processor"],
            registry=r,
        )
        self.token2text_skipped = Counter(
            "trace_proxy_token2text_skipped",
            "Trajectories exported without decoded text, by reason",
            ["reason"],
            registry=r,
        )
        self.drift_calls = Counter(
            "trace_proxy_retokenization_drift_calls",
            "Calls whose token ids drift (token2text): the next prompt does not continue "
            "their prompt and response ids (prefix), or their response ids do not survive "
            "decoding and encoding again (roundtrip)",
            ["kind"],
            registry=r,
        )
        for kind in ("prefix", "roundtrip"):  # shown at 0 before the first drift
            self.drift_calls.labels(kind)
        self.export_lag = Gauge(
            "trace_proxy_export_lag_seconds",
            "Age of the newest record a backend has exported, at the time it was exported "
            "(how far behind the traffic the backend is)",
            ["backend"],
            registry=r,
        )
        self.backend_up = Gauge(
            "trace_proxy_backend_up",
            "1 while a backend's last export succeeded, 0 while it is failing",
            ["backend"],
            registry=r,
        )


# Kinds whose samples only grow while a process lives: what a dead one counted still happened.
_CUMULATIVE = frozenset({"counter", "histogram"})


class RelayedMetrics(Collector):
    """Serves the latest samples another process sent (its registry in the text format), plus
    the counts of the processes it replaced: a helper that is killed and started again begins
    at zero, but what it counted happened (and a Prometheus counter must not fall)."""

    def __init__(self) -> None:
        self.text = ""
        self._carried: dict[str, Metric] = {}

    def retire(self) -> None:
        """The process that sent `text` is gone: keep its counters and histograms, forget its
        gauges (they described its state)."""
        self._carried = {f.name: f for f in self._merged() if f.type in _CUMULATIVE}
        self.text = ""

    def collect(self) -> Iterator[Metric]:
        yield from self._merged()

    def _merged(self) -> list[Metric]:
        current = list(text_string_to_metric_families(self.text))
        if not self._carried:
            return current
        return _add_families([*self._carried.values(), *current])

    def describe(self) -> list[Metric]:
        return []  # names are not known in advance: never checked for duplicates


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format of `registry`, with the families that several processes report (the
    forwarder's and the capture process's `trace_proxy_capture_dropped`, say) merged: samples of
    the same name and labels add up."""
    out = CollectorRegistry()
    out.register(_Families(_add_families(registry.collect())))
    return generate_latest(out)


def _add_families(collected: Iterable[Metric]) -> list[Metric]:
    """Families of the same name made one, their samples of the same name and labels added."""
    families: dict[str, Metric] = {}
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]] = {}
    for family in collected:
        if family.name not in families:
            families[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
            samples[family.name] = {}
        merged = samples[family.name]
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            seen = merged.get(key)
            if seen is None:
                merged[key] = sample
            else:
                merged[key] = seen._replace(value=seen.value + sample.value)
    for name, family in families.items():
        family.samples = list(samples[name].values())
    return list(families.values())
