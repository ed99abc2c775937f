"""The jsonl store: file layout, whole lines only, fsync on close, and `trace-proxy show`."""

from __future__ import annotations

import io
import os
from pathlib import Path

import orjson
import pytest

from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.show import show
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.record import (
    Annotation,
    CallError,
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    StepEvent,
    StepSummary,
    ToolCall,
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
    assert record["schema"] == "trace-proxy.trajectory/3"
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


# What a terminal acts on: OSC (set the title, BEL-terminated), CSI (clear, colours, as ESC [
# and as the C1 byte), cursor moves, NUL, DEL, a right-to-left override; then readable text.
EVIL = "\x1b]0;owned\x07\x1b[2J\x9b31m\x1b[1A\x00\x7f\u202e\r\t\x08 é 中文"


def test_show_prints_no_control_characters_from_records(tmp_path: Path) -> None:
    """Every string `show` prints from a record came from a request or a response: control
    and other non-printable characters are written as escapes (`\\x1b`), never as they are;
    other text stays readable."""
    call = GenerateCall(
        index=0, dialect=EVIL, route=EVIL, upstream=EVIL, start=10.0, end=11.0, http_status=500,
        model=EVIL, prompt=Prompt(messages=[{"role": EVIL, "content": EVIL}]),
        outputs=[Output(index=0, text=EVIL, finish_reason=EVIL,
                        tool_calls=[{"function": {"name": EVIL, "arguments": EVIL}}])],
        error=CallError(type=EVIL, message=EVIL),
    )  # fmt: skip
    unparsed = GenerateCall(index=1, dialect="openai.completions", route="/v1/completions",
                            upstream="u", start=11.0, end=11.5, unparsed=EVIL,
                            prompt=Prompt(text=EVIL))  # fmt: skip
    decoded = GenerateCall(index=2, dialect="vllm.generate", route="/generate", upstream="u",
                           start=11.5, end=12.0, prompt=Prompt(token_ids=[1]), prompt_text=EVIL,
                           outputs=[Output(index=0, response_text=EVIL)])  # fmt: skip
    tools = [
        ToolCall(index=0, observed=EVIL, start=11.0, end=11.2, name=EVIL, arguments=EVIL,
                 result=EVIL, requested_by=0, route=EVIL, error=CallError(EVIL, EVIL)),
        ToolCall(index=1, observed="parsed_from_text", start=11.0, end=None, raw=EVIL),
    ]  # fmt: skip
    key = RolloutKey(project=EVIL, experiment=EVIL, step=1, sample_index=0,
                     trajectory_id=EVIL)  # fmt: skip
    record = Trajectory(id=EVIL, key=key, start=10.0, end=12.0, status="error",
                        close_reason=EVIL, calls=[call, unparsed, decoded], tools=tools,
                        labels={EVIL: EVIL})  # fmt: skip
    event = StepEvent(event=EVIL, route=EVIL, upstream=EVIL, time=11.0, project=EVIL,
                      experiment=EVIL, http_status=200, weight_version=EVIL)  # fmt: skip
    summary = StepSummary(project=EVIL, experiment=EVIL, step=1, validate=False)
    late = Annotation(project=EVIL, experiment=EVIL, step=1, validate=False,
                      target={"trajectory_id": EVIL}, trajectories=[], time=12.0,
                      labels={EVIL: EVIL})  # fmt: skip
    store = JsonlExporter(tmp_path)
    store.export([record, event, summary, late])
    store.close()
    out = io.StringIO()
    assert show(tmp_path, out=out, width=1000) == 0
    text = out.getvalue()
    assert [c for c in text if c != "\n" and not c.isprintable()] == []
    shown = "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\x1b[1A\\x00\\x7f\\u202e\\r\\t\\x08 é 中文"
    assert text.count(shown) == 31  # every field printed, whole
    header = f"== {shown}/{shown} · step 1 · sample 0 · id {shown}  [error, closed: {shown}; "
    assert header + f"{shown}={shown}]" in text
    assert f"-- event {shown} version {shown} ({shown} -> 200) {shown}/{shown}" in text


def test_show_prints_versions_and_each_attempt_of_a_resumed_call(tmp_path: Path) -> None:
    """A rollout generated across a weight sync: its sample id and versions in the header, the
    call's version, and each attempt with its version, carried tokens and why it stopped."""
    record = trajectory(1, 0)
    record.key.sample_id = "uid-7"
    record.weight_version_min, record.weight_version_max = "3", "4"
    record.partial_rollout = True
    call = record.calls[0]
    call.weight_version = "4"
    call.segments = [
        {"start": 10.0, "end": 10.5, "request_id": "a", "http_status": 200,
         "finish_reason": "abort", "weight_version": "3", "carried_tokens": 0, "tokens": 5},
        {"start": 11.0, "end": 11.5, "request_id": "b", "http_status": 200,
         "finish_reason": "stop", "weight_version": "4", "carried_tokens": 5, "tokens": 2},
    ]  # fmt: skip
    store = JsonlExporter(tmp_path)
    store.export([record])
    store.close()
    out = io.StringIO()
    assert show(tmp_path, out=out) == 0
    lines = out.getvalue().splitlines()
    assert "· sample id uid-7  [ok, closed: done; versions 3 to 4, partial rollout]" in lines[0]
    assert lines[1].endswith("1.50s v4  user: 'What is 2+2?' -> '4' [stop]")
    assert lines[2:4] == [
        "     attempt 1   0.50s  version 3  generated 5 tokens  [abort]",
        "     attempt 2   0.50s  version 4  carried 5 tokens  generated 2 tokens  [stop]",
    ]


def test_show_on_a_missing_directory(tmp_path: Path) -> None:
    assert show(tmp_path / "nope", out=io.StringIO()) == 1


def test_show_reads_several_stores_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One store per replica (each sidecar writes its own): the same experiment's trajectories
    come out together, in step and sample order across the stores, from the command line too."""
    replicas = [tmp_path / "replica-0", tmp_path / "replica-1"]
    for replica, samples in zip(replicas, ([0, 2], [1, 3]), strict=True):
        store = JsonlExporter(replica)
        store.export([trajectory(step, sample) for step in (2, 1) for sample in samples])
        store.close()
    from trace_proxy.cli import main

    assert main(["show", *map(str, replicas)]) == 0
    text = capsys.readouterr().out
    headers = [line for line in text.splitlines() if line.startswith("== ")]
    order = [(h.split(" · ")[1], h.split(" · ")[2]) for h in headers]
    expected = [(f"step {step}", f"sample {s}") for step in (1, 2) for s in range(4)]
    assert order == expected
    assert text.strip().endswith(
        f"8 trajectories, 0 step events under {replicas[0]}, {replicas[1]}"
    )


def test_show_names_the_missing_one_of_several_stores(tmp_path: Path) -> None:
    store = JsonlExporter(tmp_path / "a")
    store.export([trajectory(1, 0)])
    store.close()
    assert show([tmp_path / "a", tmp_path / "nope"], out=io.StringIO()) == 1
