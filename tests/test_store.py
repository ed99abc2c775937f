"""The jsonl store: file layout, whole lines only, fsync on close, and `trace-proxy show`."""

from __future__ import annotations

import io
import os
from pathlib import Path

import orjson
import pytest

from trace_proxy.exporters.jsonl import JsonlExporter
from trace_proxy.show import iter_records, show
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    StepEvent,
    Trajectory,
)


def trajectory(
    step: int | None, sample: int, validate: bool = False, experiment: str = "e"
) -> Trajectory:
    call = GenerateCall(
        index=0, dialect="openai.chat", route="/v1/chat/completions", upstream="http://u",
        start=10.0, end=11.5, http_status=200,
        prompt=Prompt(messages=[{"role": "user", "content": "What is 2+2?"}]),
        outputs=[Output(index=0, text="4", finish_reason="stop")],
    )  # fmt: skip
    key = RolloutKey(project="p", experiment=experiment, step=step, sample_index=sample,
                     rollout_n=0, validate=validate)  # fmt: skip
    return Trajectory(id=f"t{step}-{sample}", key=key, start=10.0, end=11.5, status="ok",
                      close_reason="done", calls=[call], summary={"calls": 1})  # fmt: skip


def test_layout_one_line_per_trajectory(tmp_path: Path) -> None:
    store = JsonlExporter(tmp_path)
    event = StepEvent(event="weight_update_finish", route="/finish_weight_update", upstream="u",
                      time=1.0, project="p", experiment="e", weight_version="v2")  # fmt: skip
    store.export([trajectory(1, 0), trajectory(1, 1), trajectory(2, 0), event])
    store.export([trajectory(1, 2, validate=True), trajectory(None, 3)])
    store.close()
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.jsonl"))
    assert files == [
        "p/e/events.jsonl",
        "p/e/step-000001.jsonl",
        "p/e/step-000002.jsonl",
        "p/e/step-none.jsonl",
        "p/e/validate-step-000001.jsonl",
    ]
    lines = (tmp_path / "p/e/step-000001.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["id"] for line in lines] == ["t1-0", "t1-1"]
    record = orjson.loads(lines[0])
    assert record["schema"] == "trace-proxy.trajectory/2"
    assert record["calls"][0]["outputs"][0]["text"] == "4"


def test_files_are_fsynced_when_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store = JsonlExporter(tmp_path)
    store.export([trajectory(1, 0), trajectory(2, 0)])
    assert synced == []
    store.close()
    assert len(synced) == 2


def test_a_torn_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "p/e/step-000001.jsonl"
    path.parent.mkdir(parents=True)
    whole = orjson.dumps({"record": "trajectory", "id": "ok"}) + b"\n"
    path.write_bytes(whole + b'{"record": "trajectory", "id": "to')  # a crash mid-write
    assert [r["id"] for _, r in iter_records(tmp_path)] == ["ok"]  # readers skip it too
    store = JsonlExporter(tmp_path)
    store.export([trajectory(1, 5)])
    store.close()
    ids = [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()]
    assert ids == ["ok", "t1-5"]


def test_show_prints_one_line_per_call(tmp_path: Path) -> None:
    store = JsonlExporter(tmp_path)
    store.export([trajectory(1, 0), trajectory(2, 1)])
    store.close()
    out = io.StringIO()
    assert show(tmp_path, out=out) == 0
    text = out.getvalue()
    assert "p/e · step 1 · sample 0 · rollout 0" in text
    assert "user: 'What is 2+2?' -> '4' [stop]" in text
    assert text.strip().endswith(f"2 trajectories, 0 step events under {tmp_path}")
    out = io.StringIO()
    show(tmp_path, step=2, out=out)
    assert "step 1" not in out.getvalue() and "step 2" in out.getvalue()


def test_show_on_a_missing_directory(tmp_path: Path) -> None:
    assert show(tmp_path / "nope", out=io.StringIO()) == 1
