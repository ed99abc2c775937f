"""The export pipeline: a failing or stuck backend is retried, counted, and never holds up
another; processors run once before the fan-out and a failing one loses nothing."""

from __future__ import annotations

import asyncio
import threading

from trace_proxy.exporters.pipeline import ExportPipeline
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.record import Record, RolloutKey, Trajectory


def record(i: int) -> Trajectory:
    return Trajectory(id=f"t{i}", key=RolloutKey(project="p", experiment="e"), start=0.0,
                      end=float(i), status="ok", close_reason="done", calls=[])  # fmt: skip


class Collecting:
    name = "collect"

    def __init__(self) -> None:
        self.records: list[Record] = []

    def export(self, records: list[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


class Failing:
    """A backend that is down: fault injection."""

    name = "down"

    def __init__(self) -> None:
        self.attempts = 0

    def export(self, records: list[Record]) -> None:
        self.attempts += 1
        raise ConnectionError("backend unreachable")

    def close(self) -> None:
        pass


class Stuck:
    """A backend that hangs until released: fault injection."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.records: list[Record] = []

    def export(self, records: list[Record]) -> None:
        self.release.wait(timeout=30)
        self.records.extend(records)

    def close(self) -> None:
        pass


def value(metrics: Metrics, name: str, **labels: str) -> float:
    sample = metrics.registry.get_sample_value(name, labels)
    return sample if sample is not None else 0.0


async def test_a_dead_backend_is_retried_counted_and_does_not_hold_up_another() -> None:
    metrics = Metrics()
    good, dead = Collecting(), Failing()
    pipeline = ExportPipeline([good, dead], metrics, max_attempts=3, backoff=0.001)
    pipeline.start()
    for i in range(10):
        pipeline.submit(record(i))
    await pipeline.close()
    assert [r.id for r in good.records] == [f"t{i}" for i in range(10)]
    assert dead.attempts >= 3
    dropped = value(metrics, "trace_proxy_export_dropped_total", backend="down",
                    reason="export_failed")  # fmt: skip
    assert dropped == 10
    assert value(metrics, "trace_proxy_export_retries_total", backend="down") >= 2
    assert value(metrics, "trace_proxy_backend_up", backend="down") == 0
    assert value(metrics, "trace_proxy_backend_up", backend="collect") == 1
    assert value(metrics, "trace_proxy_exported_records_total", backend="collect") == 10


async def test_a_stuck_backend_never_stalls_the_others() -> None:
    metrics = Metrics()
    good, stuck = Collecting(), Stuck()
    pipeline = ExportPipeline([good, stuck], metrics, queue_size=4)
    pipeline.start()

    async def exported(count: int) -> None:
        while len(good.records) < count:  # polls an observable result, bounded by wait_for
            await asyncio.sleep(0.005)

    for i in range(20):
        pipeline.submit(record(i))
        await asyncio.wait_for(exported(i + 1), 10)
    assert len(stuck.records) == 0  # still holding its thread
    full = value(metrics, "trace_proxy_export_dropped_total", backend="stuck", reason="queue_full")
    assert full > 0  # its bounded queue overflowed: counted, not silently lost
    stuck.release.set()
    await pipeline.close()
    assert len(stuck.records) + full == 20


async def test_a_failing_processor_exports_records_as_they_are() -> None:
    class Broken:
        name = "broken"

        def process(self, records: list[Record]) -> None:
            raise RuntimeError("tokenizer exploded")

    metrics = Metrics()
    good = Collecting()
    pipeline = ExportPipeline([good], metrics, processors=[Broken()])
    pipeline.start()
    pipeline.submit(record(1))
    await pipeline.close()
    assert [r.id for r in good.records] == ["t1"]
    assert value(metrics, "trace_proxy_processing_errors_total", processor="broken") == 1
