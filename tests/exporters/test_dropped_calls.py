"""A trajectory whose every call was dropped (capture fell behind and kept only the calls'
heads) still reaches each backend: an empty trajectory that says how many calls are missing
and when they ran, so its sample is not silently absent from the step."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import uuid
from pathlib import Path
from typing import Any

import pytest

from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.show import show
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.record import Trajectory

T0 = 1_700_000_000.0
MISSING = 3


def all_dropped(project: str = "tp") -> Trajectory:
    """As the assembler builds it from three dropped marks, the last one saying done."""
    out: list[Any] = []
    assembler = Assembler(out.append, project=project, experiment="e", idle_timeout=10)
    for turn in range(MISSING):
        values: dict[str, Any] = {"step": 4, "sample_index": 2, "rollout_n": 1}
        if turn == MISSING - 1:
            values["done"] = True
        assembler.add_dropped(KeyHints(values=values), T0 + turn, T0 + turn + 0.5)
    [built] = out
    assert isinstance(built, Trajectory) and built.close_reason == "done"
    assert (built.start, built.end, built.calls, built.tools) == (T0, T0 + 2.5, [], [])
    assert built.summary["calls_dropped"] == MISSING
    return built


def test_jsonl_and_show(tmp_path: Path) -> None:
    JsonlExporter(tmp_path).export([all_dropped()])
    out = io.StringIO()
    assert show(tmp_path, out=out) == 0
    shown = out.getvalue()
    assert "step 4" in shown and f"{MISSING} more calls not recorded" in shown
    # A store may also be named by one of its project or experiment directories.
    for part in (tmp_path / "tp", tmp_path / "tp" / "e"):
        out = io.StringIO()
        assert show(part, out=out) == 0
        # the same, but for the last line, which names what was read
        assert out.getvalue().splitlines()[:-1] == shown.splitlines()[:-1]


def test_otlp() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trace_proxy.exporters.backends.otlp import OtlpExporter

    memory = InMemorySpanExporter()
    OtlpExporter("http://unused", {}, span_exporter=memory).export([all_dropped()])
    [root] = memory.get_finished_spans()
    assert root.attributes is not None
    assert root.attributes["trace_proxy.summary.calls_dropped"] == MISSING
    assert root.attributes["rollout.sample_index"] == 2
    assert (root.start_time, root.end_time) == (int(T0 * 1e9), int((T0 + 2.5) * 1e9))


def test_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    from trace_proxy.exporters.backends.mlflow import MlflowExporter, trace_id_of

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    record = all_dropped()
    exporter = MlflowExporter(uri, "tp", None)
    exporter.export([record])
    exporter.close()
    trace = mlflow.get_trace(trace_id_of(record.id))
    [root] = trace.data.spans
    assert root.attributes["summary"]["calls_dropped"] == MISSING
    assert trace.info.tags["sample_index"] == "2"


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="no trackio extra")
def test_trackio(trackio_dir: Path) -> None:
    # Not importorskip: importing trackio would fix its directory before the exporter sets it.
    from trace_proxy.exporters.backends.trackio import TrackioExporter

    project = f"tp-dropped-{uuid.uuid4().hex[:12]}"
    exporter = TrackioExporter(project, trackio_dir)
    exporter.export([all_dropped(project)])
    exporter.close()
    from trackio.sqlite_storage import SQLiteStorage

    [trace] = SQLiteStorage.get_traces(project, run="e")
    assert [span["kind"] for span in trace["spans"]] == ["span"]
    assert trace["metadata"]["calls_dropped"] == MISSING
    assert trace["metadata"]["num_turns"] == 0


async def test_weave() -> None:
    pytest.importorskip("weave")
    from fakes.weave_server import FakeWeaveServer

    from trace_proxy.exporters.backends.weave import WeaveExporter, call_id

    record = all_dropped()
    fake = FakeWeaveServer()
    async with fake.serve() as url:
        exporter = WeaveExporter("ent", "proj", server_url=url, api_key="k" * 40)
        await asyncio.wait_for(asyncio.to_thread(exporter.export, [record]), 30)
    assert [call["id"] for call in fake.calls] == [call_id(record.id, "root")]
    root = fake.stored[call_id(record.id, "root")]
    assert root["output"]["summary"]["calls_dropped"] == MISSING
    assert root["attributes"]["sample_index"] == 2
