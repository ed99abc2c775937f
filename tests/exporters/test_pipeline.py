"""The export pipeline: records wait in the spool until every backend has them; a failing,
stuck or rejecting backend is retried, bounded and counted, and never holds up another; a crash
loses nothing and a replay duplicates nothing; a failing processor loses nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from support.proxies import inline_pipeline, metric, trajectories

from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.exporters.base import Capabilities, Exporter, ExportRejected, Processor
from trace_proxy.exporters.pipeline import ExportPipeline
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import Cursor, CursorState, SpoolWriter
from trace_proxy.metrics import ExportMetrics, Metrics
from trace_proxy.store.layout import record_names
from trace_proxy.store.names import store_name
from trace_proxy.trajectories.record import (
    SCHEMA_VERSION,
    GenerateCall,
    Output,
    Prompt,
    Record,
    RolloutKey,
    SpooledTrajectory,
    StepEvent,
    Trajectory,
    dumps,
    loads,
    spooled_trajectory,
)


def record(i: int, payload: str = "") -> Trajectory:
    return Trajectory(id=f"t{i}", key=RolloutKey(project="p", experiment="e"), start=0.0,
                      end=float(i), status="ok", close_reason="done", calls=[],
                      labels={"payload": payload} if payload else {})  # fmt: skip


class Collecting(Exporter):
    def __init__(self, name: str = "collect") -> None:
        self.name = name
        self.records: list[Record] = []

    def export(self, records: list[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


class Failing(Exporter):
    """A backend that is down: fault injection."""

    name = "down"

    def __init__(self) -> None:
        self.attempts = 0

    def export(self, records: list[Record]) -> None:
        self.attempts += 1
        raise ConnectionError("backend unreachable")

    def close(self) -> None:
        pass


class Stuck(Exporter):
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


def ids(records: list[Record]) -> list[str]:
    return [r.id for r in records if isinstance(r, Trajectory)]


async def until(condition: object, timeout: float = 10) -> None:
    """Polls an observable result, bounded by a timeout."""

    async def poll() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


async def test_a_dead_backend_keeps_its_records_spooled_until_it_is_back(tmp_path: Path) -> None:
    good, dead = Collecting(), Failing()
    pipeline, metrics = inline_pipeline(tmp_path, [good, dead])
    await pipeline.start()
    for i in range(10):
        pipeline.submit(record(i))
    await until(lambda: len(good.records) == 10 and dead.attempts >= 3)
    await pipeline.close(timeout=0.05)  # the dead one cannot catch up: its records stay
    assert ids(good.records) == [f"t{i}" for i in range(10)]
    assert metric(metrics, "trace_proxy_export_retries_total", backend="down") >= 2
    assert metric(metrics, "trace_proxy_backend_up", backend="down") == 0
    assert metric(metrics, "trace_proxy_backend_up", backend="collect") == 1
    assert metric(metrics, "trace_proxy_exported_records_total", backend="collect") == 10
    assert metric(metrics, "trace_proxy_export_dropped_total", backend="down",
                  reason="spool_full") == 0  # fmt: skip
    assert Cursor(tmp_path, "down").load().next == 0

    # The next start: the backend is up again and gets every record once; the other gets none.
    back, again = Collecting("down"), Collecting()
    pipeline, metrics = inline_pipeline(tmp_path, [again, back])
    await pipeline.start()
    await pipeline.flush()
    await pipeline.close()
    assert ids(back.records) == [f"t{i}" for i in range(10)]
    assert again.records == []


async def test_a_stuck_backend_never_stalls_the_others_and_the_disk_budget_bounds_it(
    tmp_path: Path,
) -> None:
    good, stuck = Collecting(), Stuck()
    budget = 8 << 10
    pipeline, metrics = inline_pipeline(
        tmp_path, [good, stuck], max_bytes=budget, segment_bytes=1 << 10
    )
    await pipeline.start()
    for i in range(60):
        pipeline.submit(record(i, payload="x" * 200))  # about 300 bytes each
        await until(lambda n=i + 1: len(good.records) == n)  # type: ignore[misc]
    assert stuck.records == []  # still holding its thread
    assert pipeline.spool.used_bytes <= budget
    stuck.release.set()
    await pipeline.flush()
    await pipeline.close()
    assert ids(good.records) == [f"t{i}" for i in range(60)]
    lost = metric(metrics, "trace_proxy_export_dropped_total", backend="stuck", reason="spool_full")
    assert lost > 0  # the budget deleted what it had not read: counted, not silently lost
    assert len(stuck.records) + lost == 60
    assert sorted(ids(stuck.records), key=lambda s: int(s[1:])) == ids(stuck.records)  # in order
    assert metric(metrics, "trace_proxy_export_dropped_total", backend="collect",
                  reason="spool_full") == 0  # fmt: skip


async def test_a_rejected_record_is_dropped_and_the_rest_of_its_batch_goes_out(
    tmp_path: Path,
) -> None:
    class Picky(Collecting):
        def export(self, records: list[Record]) -> None:
            if "t3" in ids(records):
                raise ExportRejected("t3 is too large for this backend")
            super().export(records)

    picky = Picky("picky")
    pipeline, metrics = inline_pipeline(tmp_path, [picky])
    await pipeline.start()
    for i in range(6):
        pipeline.submit(record(i))
    await pipeline.flush()
    await pipeline.close()
    assert sorted(ids(picky.records)) == ["t0", "t1", "t2", "t4", "t5"]
    assert metric(metrics, "trace_proxy_export_dropped_total", backend="picky",
                  reason="rejected") == 1  # fmt: skip


async def test_a_record_that_cannot_be_encoded_is_counted_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    """A record JSON cannot carry (a bug: here a value of no JSON type) is dropped and counted
    as `unencodable`; it used to end the spool's writer, and every record after it waited."""
    good = Collecting()
    pipeline, metrics = inline_pipeline(tmp_path, [good])
    await pipeline.start()
    broken = record(1)
    broken.labels = {"x": object()}
    for item in (record(0), broken, record(2)):
        pipeline.submit(item)
    await asyncio.wait_for(pipeline.flush(), 30)  # a writer that stopped never flushes
    pipeline.submit(record(3))
    await asyncio.wait_for(pipeline.flush(), 30)
    await pipeline.close()
    assert ids(good.records) == ["t0", "t2", "t3"]
    assert metric(metrics, "trace_proxy_spool_dropped_total", reason="unencodable") == 1


async def test_a_failing_processor_exports_records_as_they_are(tmp_path: Path) -> None:
    class Broken(Processor):
        name = "broken"

        def process(self, records: list[Record]) -> None:
            raise RuntimeError("tokenizer exploded")

    good = Collecting()
    pipeline, metrics = inline_pipeline(tmp_path, [good], processors=[Broken()])
    await pipeline.start()
    pipeline.submit(record(1))
    await pipeline.flush()
    await pipeline.close()
    assert ids(good.records) == ["t1"]
    assert metric(metrics, "trace_proxy_processing_errors_total", processor="broken") == 1


async def test_processors_run_once_for_all_backends(tmp_path: Path) -> None:
    class Counting(Processor):
        name = "counting"

        def __init__(self) -> None:
            self.seen: list[str] = []

        def process(self, records: list[Record]) -> None:
            self.seen.extend(ids(records))

    counting = Counting()
    first, second = Collecting("first"), Collecting("second")
    pipeline, _ = inline_pipeline(tmp_path, [first, second], processors=[counting])
    await pipeline.start()
    for i in range(20):
        pipeline.submit(record(i))
    await pipeline.flush()
    await pipeline.close()
    assert ids(first.records) == ids(second.records) == [f"t{i}" for i in range(20)]
    assert sorted(counting.seen) == sorted(f"t{i}" for i in range(20))


CRASHING_RUN = """
import asyncio, os, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from support.proxies import inline_pipeline
from exporters.test_pipeline import record
from trace_proxy.exporters.backends.jsonl import JsonlExporter

class CrashesAfterItsSecondBatch(JsonlExporter):
    batches = 0
    def export_lines(self, records):  # what the runner calls for jsonl
        super().export_lines(records)
        self.batches += 1
        if self.batches == 2:
            os._exit(9)  # the line is written, the cursor is not: the worst moment

async def main():
    output = Path({output!r})
    pipeline, _ = inline_pipeline(output / ".spool", [CrashesAfterItsSecondBatch(output)],
                                  batch_size=4)
    await pipeline.start()
    for i in range(20):
        pipeline.submit(record(i))
    await pipeline.flush()

asyncio.run(main())
"""


async def test_a_crash_loses_nothing_and_the_replay_duplicates_nothing(tmp_path: Path) -> None:
    tests = str(Path(__file__).parents[1])
    script = textwrap.dedent(CRASHING_RUN).format(tests=tests, output=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": tests}
    crashed = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, check=False)
    assert crashed.returncode == 9
    assert len(trajectories(tmp_path)) == 8  # two batches of 4 were written before the crash
    assert Cursor(tmp_path / ".spool", "jsonl").load().pending == 8

    pipeline, _ = inline_pipeline(tmp_path / ".spool", [JsonlExporter(tmp_path)], batch_size=4)
    await pipeline.start()
    await pipeline.flush()
    await pipeline.close()
    assert sorted(t["id"] for t in trajectories(tmp_path)) == sorted(f"t{i}" for i in range(20))


def full_trajectory(i: int, experiment: str) -> Trajectory:
    """A trajectory with calls, tools and a key whose strings spell JSON of the record's head."""
    key = RolloutKey(
        project="p",
        experiment=experiment,
        step=i % 3,
        sample_index=i,
        rollout_n=0,
        validate=i % 2 == 1,
        sources={"step": "header:X-Rollout-Step"},
    )
    call = GenerateCall(
        index=0,
        dialect="openai.completions",
        route="/v1/completions",
        upstream="http://u",
        start=1.5,
        end=2.25,
        stream=False,
        prompt=Prompt(token_ids=[1, 2, 3]),
        outputs=[Output(index=0, token_ids=[4], text=' ,"status":"error"')],
    )
    return Trajectory(id=f"t{i}", key=key, start=1.5, end=2.25 + i, status="ok",
                      close_reason="done", calls=[call], labels={"note": '"},"status":'},
                      summary={"calls": 1})  # fmt: skip


def event(name: str, time: float) -> StepEvent:
    return StepEvent(name, f"/{name}", "http://u", time, project="p", experiment="e")


class Unchanging(Processor):
    """A processor that changes nothing but does not say so: records are decoded for it."""

    name = "unchanging"

    def process(self, records: list[Record]) -> None:
        pass


class Idle(Unchanging):
    """One that says so (token2text without a tokenizer), and counts what went by."""

    name = "idle"
    inactive = True

    def __init__(self) -> None:
        self.passed = 0

    def passed_over(self, trajectories: int) -> None:
        self.passed += trajectories


async def test_spooled_lines_are_written_as_a_decoded_record_would_be(tmp_path: Path) -> None:
    experiments = ["e", 'e ,"status":"x" }', 'e\\u002c"start":{', "ü"]
    records: list[Record] = [full_trajectory(i, experiments[i % 4]) for i in range(12)]
    records.insert(5, event("weight_update", 3.0))
    stores = {}
    for name, processor in (("decoded", Unchanging()), ("spooled", Idle())):
        output = tmp_path / name
        pipeline, _ = inline_pipeline(
            output / ".spool", [JsonlExporter(output)], processors=[processor], batch_size=5
        )
        await pipeline.start()
        for item in records:
            pipeline.submit(item)
        await pipeline.flush()
        await pipeline.close()
        stores[name] = {
            path.relative_to(output): path.read_bytes() for path in output.rglob("*.jsonl")
        }
        if isinstance(processor, Idle):
            assert processor.passed == 12
    expected = set()
    for record in records:
        project, experiment, file_name = record_names(record)
        expected.add(Path(store_name(project), store_name(experiment), file_name))
    assert set(stores["decoded"]) == expected
    assert stores["spooled"] == stores["decoded"]
    lines = b"".join(stores["spooled"].values()).splitlines()
    assert sorted(loads(line).record for line in lines) == ["event"] + ["trajectory"] * 12


class Telling(JsonlExporter):
    """The jsonl store under another name and with the capabilities it is given, counting
    the spool lines it is handed and how often it is asked what it already holds."""

    def __init__(self, output: Path, name: str, capabilities: Capabilities) -> None:
        super().__init__(output)
        self.name = name
        self.capabilities = capabilities
        self.lines = 0
        self.asked = 0

    def export_lines(self, records: Sequence[Record | SpooledTrajectory]) -> None:
        self.lines += sum(isinstance(r, SpooledTrajectory) for r in records)
        super().export_lines(records)

    def exported_ids(self, records: list[Trajectory]) -> set[str]:
        self.asked += 1
        return super().exported_ids(records)


async def test_a_backend_is_asked_only_what_its_capabilities_say(tmp_path: Path) -> None:
    """What a backend can do is what it declares: one that declares nothing (`plain`, or
    `undeclared`, which has the methods) gets decoded records through `export`, and after a
    crash the whole batch that was in flight again; the jsonl store's declaration gets it
    spool lines and no duplicate."""
    spool = tmp_path / ".spool"

    def backends() -> tuple[Telling, Telling, Collecting]:
        return (
            Telling(tmp_path / "declared", "declared", JsonlExporter.capabilities),
            Telling(tmp_path / "undeclared", "undeclared", Capabilities()),
            Collecting("plain"),
        )

    declared, undeclared, plain = backends()
    idle = Idle()
    pipeline, _ = inline_pipeline(spool, [declared, undeclared, plain], processors=[idle])
    await pipeline.start()
    for i in range(8):
        pipeline.submit(record(i))
    await pipeline.flush()
    await pipeline.close()
    assert (declared.lines, undeclared.lines) == (8, 0)
    assert all(isinstance(r, Trajectory) for r in plain.records) and len(plain.records) == 8
    assert idle.passed == 8  # counted by the one lane that took lines

    for name in ("declared", "undeclared", "plain"):  # a crash before any cursor moved on
        Cursor(spool, name).save(CursorState(0, 8))
    declared, undeclared, plain = backends()
    pipeline, _ = inline_pipeline(spool, [declared, undeclared, plain], processors=[Idle()])
    await pipeline.start()
    await pipeline.flush()
    await pipeline.close()
    assert declared.asked > 0 and undeclared.asked == 0
    assert sorted(t["id"] for t in trajectories(tmp_path / "declared")) == [
        f"t{i}" for i in range(8)
    ]
    assert len(trajectories(tmp_path / "undeclared")) == 16  # sent again, as it cannot tell
    assert ids(plain.records) == [f"t{i}" for i in range(8)]


def test_only_trajectory_lines_of_this_schema_are_taken_by_their_head() -> None:
    line = dumps(full_trajectory(7, 'x ,"status":"y"'))
    head = spooled_trajectory(line)
    assert head is not None
    assert (head.id, head.key.experiment, head.key.step, head.end) == ("t7", 'x ,"status":"y"', 1,
                                                                        9.25)  # fmt: skip
    assert head.line is line
    other_schema = line.replace(SCHEMA_VERSION.encode(), b"trace-proxy.trajectory/1")
    bare = b'{"id":"t","record":"trajectory"}'
    for not_taken in (other_schema, dumps(event("pause", 1.0)), line[:-1], bare):
        assert spooled_trajectory(not_taken) is None


class Slow(Collecting):
    """A backend that takes 20 ms per batch, as a remote one does; counts its batches."""

    def __init__(self) -> None:
        super().__init__("slow")
        self.batches = 0

    def export(self, records: list[Record]) -> None:
        self.batches += 1
        time.sleep(0.02)
        super().export(records)


async def test_a_trickle_of_records_goes_out_in_few_batches(tmp_path: Path) -> None:
    """Records that arrive one at a time while a lane exports (a rollout's pace) wait for the
    linger and go out together: each batch costs cursor writes and thread hops whatever its
    size. Without lingering after a batch, each 20 ms export was followed at once by another
    of the few records that came meanwhile (11 or 12 batches here, measured)."""
    backend = Slow()
    metrics = Metrics()
    runner = ExportRunner(tmp_path / "spool", [backend], ExportMetrics(metrics.registry),
                          linger=0.1)  # fmt: skip
    pipeline = ExportPipeline(runner, metrics, SpoolWriter(tmp_path / "spool", max_bytes=1 << 30))
    await pipeline.start()
    for i in range(60):  # one record every 5 ms, for 0.3 s
        pipeline.submit(record(i))
        await asyncio.sleep(0.005)
    await asyncio.wait_for(pipeline.flush(), 30)
    assert [r.id for r in backend.records] == [f"t{i}" for i in range(60)]
    assert backend.batches <= 6, backend.batches
    await pipeline.close()
