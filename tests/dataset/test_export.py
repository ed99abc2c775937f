"""`trace-proxy export`: a store made by real proxies, written as Parquet, read back with
`datasets.load_dataset("parquet", ...)` as a training script would, and compared with what the
agents sent and got (tests/support/dataset_workload.py)."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")

import aiohttp  # noqa: E402
from support import version_workload  # noqa: E402
from support.dataset_workload import Sent, make_store  # noqa: E402
from support.proxies import running_proxy, trajectories  # noqa: E402

from trace_proxy.dataset.build import write_dataset  # noqa: E402
from trace_proxy.dataset.reading import (  # noqa: E402
    UNREADABLE,
    Selection,
    SelectionError,
    StepRange,
)
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer  # noqa: E402

Key = tuple[int, int, int, bool]


@pytest.fixture(scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer: Any) -> tuple[Path, Sent]:
    output = tmp_path_factory.mktemp("export") / "traces"
    sent = await make_store(output, qwen_tokenizer, str(ensure_qwen_tokenizer()))
    return output, sent


def load(directory: Path) -> list[dict[str, Any]]:
    """The rows as `datasets` reads them from the export's files."""
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    loaded = datasets.load_dataset("parquet", data_files=files, split="train")
    return [dict(row) for row in loaded]


def export(store: Path, out: Path, form: str, **selection: Any) -> list[dict[str, Any]]:
    tokenizer = selection.pop("tokenizer", None)
    rows_per_file = selection.pop("rows_per_file", 100_000)
    write_dataset(store, out, form, Selection(**selection), tokenizer=tokenizer,
                  rows_per_file=rows_per_file)  # fmt: skip
    return load(out)


def key_of(row: dict[str, Any]) -> Key:
    return (row["step"], row["sample_index"], row["rollout_n"], row["validate"])


def test_sft_rows_are_the_conversations_with_tool_calls_results_and_late_rewards(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, sent = store
    rows = export(output, tmp_path / "sft", "sft")
    by_key = {key_of(row): row for row in rows}
    training = {k for k in [*sent.messages, *sent.turns] if not k[3]}
    assert sorted(by_key) == sorted(training)  # one row per trajectory; validation left out
    assert len(rows) == len(training)  # the trajectory that reached both proxies: one row

    for key, messages in sent.messages.items():
        if key[3]:
            continue
        row = by_key[key]
        assert row["reward"] == sent.rewards[key]  # posted after the record was written
        assert json.loads(row["labels"]) == {"judge": "late"}
        assert row["project"] == "default" and row["experiment"] == "export"
        assert row["turns"] == sum(1 for m in messages if m["role"] == "assistant")
        got = row["messages"]
        assert [m["role"] for m in got] == [m["role"] for m in messages]
        for mine, theirs in zip(got, messages, strict=True):
            assert mine["content"] == theirs.get("content")
            if theirs["role"] == "tool":
                assert mine["tool_call_id"] == theirs["tool_call_id"]
            calls = theirs.get("tool_calls") or []
            assert [c["id"] for c in mine["tool_calls"] or []] == [c["id"] for c in calls]
            assert [c["function"] for c in mine["tool_calls"] or []] == [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in calls
            ]
        assert json.loads(row["tools"])[0]["function"]["name"] == "get_weather"
    assert by_key[(1, 2, 0, False)]["trajectory_id"] == "both-proxies"
    assert by_key[(1, 2, 0, False)]["turns"] >= 2


def test_sft_rows_of_token_in_trajectories_come_from_decoded_text_and_tool_spans(
    store: tuple[Path, Sent], tmp_path: Path, qwen_tokenizer: Any
) -> None:
    output, sent = store
    rows = {key_of(r): r for r in export(output, tmp_path / "sft", "sft", steps=StepRange(2, 2))}
    for key, turns in sent.turns.items():
        row = rows[key]
        assert row["reward"] == sent.rewards[key]  # posted with `done` while it was open
        messages = row["messages"]
        roles = [m["role"] for m in messages]
        calls = len(sent.results[key])
        assert roles == ["system", "user", *["assistant", "tool"] * calls, "assistant"]
        assert len(turns) == calls + 1
        tools = [m for m in messages if m["role"] == "tool"]
        assert [m["content"] for m in tools] == sent.results[key]
        asked = [m for m in messages if m["role"] == "assistant" and m["tool_calls"]]
        assert [m["tool_calls"][0]["id"] for m in asked] == [m["tool_call_id"] for m in tools]
        assert {m["tool_calls"][0]["function"]["name"] for m in asked} <= {
            "get_weather", "calculator"
        }  # fmt: skip
        assert "<tool_call>" not in (messages[-1]["content"] or "")
        answer = qwen_tokenizer.decode(turns[-1][1], skip_special_tokens=True)
        assert messages[-1]["content"].strip() == answer.strip()  # the last answer, as said
        assert "<tools>" in messages[0]["content"]  # the system turn as the template wrote it
        assert row["text"].startswith("<|im_start|>system")


def test_rl_rows_replay_each_turn_with_ids_mask_and_logprobs(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, sent = store
    rows = export(output, tmp_path / "rl", "rl", validation="include")
    by_trajectory: dict[Key, list[dict[str, Any]]] = {}
    for row in rows:
        by_trajectory.setdefault(key_of(row), []).append(row)
    for key, turns in sent.turns.items():
        replayed = sorted(by_trajectory[key], key=lambda r: r["turn"])
        assert [(r["prompt_ids"], r["response_ids"]) for r in replayed] == turns
        for row in replayed:
            assert row["loss_mask"] == [1] * len(row["response_ids"])
            assert len(row["logprobs"]) == len(row["response_ids"])
            assert all(lp <= 0 for lp in row["logprobs"])
            assert row["reward"] == sent.rewards[key] and row["ids_from"] == "record"
            assert row["turns"] == len(turns) and row["group"] == f"sample {key[1]}"
        assert {r["finish_reason"] for r in replayed} == {"stop"}
    for key in sent.messages:
        replayed = sorted(by_trajectory[key], key=lambda r: r["turn"])
        assert len(replayed) == sum(1 for m in sent.messages[key] if m["role"] == "assistant")
        assert {r["reward"] for r in replayed} == {sent.rewards[key]}  # late, merged
        if key == (2, 2, 0, False):  # chat without return_token_ids: nothing to replay
            assert all(r["prompt_ids"] is None and r["ids_from"] is None for r in replayed)
            continue
        for before, after in itertools.pairwise(replayed):
            # the next prompt continues this one: prompt, answer (its end-of-turn), tool tokens
            assert after["prompt_ids"][: len(before["prompt_ids"])] == before["prompt_ids"]
        for row in replayed:
            assert row["ids_from"] == "record" and row["response_ids"]
            assert len(row["loss_mask"]) == len(row["response_ids"])
    assert any(key[3] for key in by_trajectory)  # validation taken with --validation include


def test_rl_ids_a_call_lacks_come_from_the_tokenizer_as_the_server_made_them(
    store: tuple[Path, Sent], tmp_path: Path, qwen_tokenizer: Any
) -> None:
    """The chat rollout recorded without ids and its twin (the same question and seed) recorded
    with them: the ids filled from the tokenizer are the server's."""
    output, _ = store
    rows = export(output, tmp_path / "rl", "rl", steps=StepRange(2, 2), tokenizer=qwen_tokenizer)
    filled = sorted((r for r in rows if r["sample_index"] == 2), key=lambda r: r["turn"])
    twin = sorted((r for r in rows if r["sample_index"] == 5), key=lambda r: r["turn"])
    assert filled and {r["ids_from"] for r in filled} == {"tokenizer"}
    assert [r["prompt_ids"] for r in filled] == [r["prompt_ids"] for r in twin]
    assert [r["response_ids"] for r in filled] == [r["response_ids"] for r in twin]
    assert all(r["loss_mask"] == [1] * len(r["response_ids"]) for r in filled)


def test_a_store_recorded_without_a_tokenizer_exports_as_one_with_it(
    store: tuple[Path, Sent], tmp_path: Path, qwen_tokenizer: Any
) -> None:
    """The same store with every decoded text taken out (as a proxy without token2text writes
    it): token-in trajectories have no messages, unless `--tokenizer` decodes them; then each
    SFT row is the one token2text's text gave."""
    output, sent = store
    bare = tmp_path / "bare"
    shutil.copytree(output, bare)
    for path in bare.rglob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for record in records:
            if record.get("record") != "trajectory":
                continue
            record["transcript"] = None
            for made in record["calls"]:
                made["prompt_text"] = None
                for output_ in made["outputs"]:
                    output_.pop("response_text", None)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = StepRange(2, 2)
    decoded = {key_of(r): r for r in export(output, tmp_path / "a", "sft", steps=steps)}
    plain = {key_of(r): r for r in export(bare, tmp_path / "b", "sft", steps=steps)}
    filled = {key_of(r): r for r in export(bare, tmp_path / "c", "sft", steps=steps,
                                           tokenizer=qwen_tokenizer)}  # fmt: skip
    token_in = set(sent.turns) & set(decoded)
    assert token_in and all(plain[k]["messages"] is None for k in token_in)
    assert filled == decoded


def test_filters_choose_steps_validation_rewards_and_runs(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, sent = store

    def keys(name: str, **selection: Any) -> set[Key]:
        return {key_of(r) for r in export(output, tmp_path / name, "sft", **selection)}

    everything = set(sent.messages) | set(sent.turns)
    assert keys("one", steps=StepRange(1, 1)) == {k for k in everything if k[0] == 1}
    assert keys("open", steps=StepRange(2, None)) == {
        k for k in everything if k[0] == 2 and not k[3]
    }
    assert keys("validation", validation="only") == {k for k in everything if k[3]}
    assert keys("all", validation="include") == everything
    assert keys("rewarded", min_reward=0.2, max_reward=1.0, validation="include") == {
        k for k in everything if 0.2 <= sent.rewards[k] <= 1.0
    }
    assert keys("run", run="default/export") == {k for k in everything if not k[3]}
    with pytest.raises(SelectionError, match="no such run"):
        keys("none", run="default/other")


def test_several_files_read_as_one_dataset_in_order(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, _ = store
    whole = export(output, tmp_path / "whole", "rl")
    parts = export(output, tmp_path / "parts", "rl", rows_per_file=4)
    assert len(list((tmp_path / "parts").glob("part-*.parquet"))) == -(-len(whole) // 4) > 2
    assert parts == whole
    assert not list((tmp_path / "parts").glob(".*"))  # no partial file left


def test_a_line_that_is_not_a_record_is_passed_over_and_counted(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, sent = store
    copy = tmp_path / "traces"
    shutil.copytree(output, copy)
    step_file = next(copy.glob("replicas/a/*/*/step-000002.jsonl"))
    with step_file.open("ab") as handle:
        handle.write(b'{"record": "trajectory", "id": \n[1, 2]\n')
    written = write_dataset(copy, tmp_path / "out", "sft", Selection())
    assert written.rows == len([k for k in [*sent.messages, *sent.turns] if not k[3]])
    assert written.tally.notes[UNREADABLE] == 2
    assert "2 lines of the store that are not records" in written.tally.describe()


def test_the_progress_bar_shows_on_a_terminal_only(
    store: tuple[Path, Sent], tmp_path: Path
) -> None:
    output, _ = store
    args = [sys.executable, "-m", "trace_proxy", "export", str(output), "--form", "rl"]
    quiet = subprocess.run([*args, "--out", str(tmp_path / "a")], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == ""
    terminal, other = pty.openpty()
    fcntl.ioctl(other, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    with os.fdopen(terminal, "rb") as screen:
        shown = subprocess.run([*args, "--out", str(tmp_path / "b")], stdout=subprocess.DEVNULL,
                               stderr=other, timeout=120)  # fmt: skip
        os.close(other)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the writer is gone and all is read
            while chunk := screen.read1(4096):
                drawn += chunk
    assert shown.returncode == 0
    assert b"export rl" in drawn and b"B/s" in drawn


def trace_proxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trace_proxy", *args], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_command_as_a_user_runs_it(store: tuple[Path, Sent], tmp_path: Path) -> None:
    output, sent = store
    out = tmp_path / "sft"
    done = trace_proxy("export", str(output), "--form", "sft", "--out", str(out), "--step", "1")
    assert done.returncode == 0, done.stderr
    step_one = [k for k in sent.messages if k[0] == 1]
    assert f"wrote {len(step_one)} sft rows in 1 Parquet file(s)" in done.stdout
    assert len(load(out)) == len(step_one)

    again = trace_proxy("export", str(output), "--form", "rl", "--out", str(out))
    assert again.returncode == 2 and "is not empty" in again.stderr and "--force" in again.stderr
    assert len(load(out)) == len(step_one)  # nothing lost
    (out / "notes.txt").write_text("mine")
    forced = trace_proxy("export", str(output), "--form", "rl", "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "turns without token ids (null; give --tokenizer to fill them)" in forced.stdout
    assert "step files not read: 1 by --validation" in forced.stdout
    assert "prompt_ids" in load(out)[0] and (out / "notes.txt").read_text() == "mine"


def test_show_gives_the_rewards_the_export_gives(store: tuple[Path, Sent], tmp_path: Path) -> None:
    """Both merge a late reward into each replica's record before joining them: the trajectory
    whose turns reached both proxies was rewarded through the proxy of its later turns."""
    output, sent = store
    shown = trace_proxy("show", str(output), "--step", "1")
    assert shown.returncode == 0, shown.stderr
    header = next(line for line in shown.stdout.splitlines() if "id both-proxies" in line)
    assert f"reward {sent.rewards[(1, 2, 0, False)]:g}, judge=late" in header
    rows = export(output, tmp_path / "sft", "sft", steps=StepRange(1, 1))
    assert {r["reward"] for r in rows if r["trajectory_id"] == "both-proxies"} == {
        sent.rewards[(1, 2, 0, False)]
    }


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--step", "x:y"], "expected a step"),
        (["--step", "5:2"], "first step is after its last"),
        (["--min-reward", "2", "--max-reward", "1"], "--min-reward is above --max-reward"),
        (["--run", "nope"], "no such run"),
        (["--tool-parser", "nope"], "--tool-parser"),
        (["--tokenizer", "/nonexistent/tokenizer"], "invalid value for --tokenizer"),
        (["--form", "csv"], "invalid choice"),
    ],
)
def test_bad_input_is_refused_with_exit_code_2(
    store: tuple[Path, Sent], tmp_path: Path, arguments: list[str], message: str
) -> None:
    output, _ = store
    out = tmp_path / "out"
    args = ["export", str(output), "--out", str(out)]
    args += [] if "--form" in arguments else ["--form", "sft"]
    done = trace_proxy(*args, *arguments)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback
    assert not out.exists() or not list(out.iterdir())


def test_no_store_and_a_missing_extra_are_named(tmp_path: Path) -> None:
    missing = trace_proxy("export", str(tmp_path / "nope"), "--form", "rl", "--out",
                          str(tmp_path / "out"))  # fmt: skip
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    empty = trace_proxy("export", str(tmp_path), "--form", "rl", "--out", str(tmp_path / "o"))
    assert empty.returncode == 2 and "holds no stored runs" in empty.stderr
    argv = ["export", str(tmp_path), "--form", "rl", "--out", "x"]
    code = ("import sys; sys.modules['pyarrow'] = None; from trace_proxy.cli import main; "
            f"sys.exit(main({argv!r}))")  # fmt: skip
    blocked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert blocked.returncode == 2
    assert "pip install 'trace-proxy[dataset]'" in blocked.stderr


async def test_rl_rows_carry_each_calls_versions_and_how_stale_it_was(
    tmp_path: Path, qwen_tokenizer: Any
) -> None:
    """A partial rollout resumed across a weight sync and a rollout on one version, closed
    after the next sync (tests/support/version_workload.py): each row says the version of its call
    and of each attempt, how many versions behind the newest at close it was, and its
    trajectory's sample id, oldest, newest and newest-seen versions and partial flag."""
    output = tmp_path / "traces"
    async with version_workload.upstream(qwen_tokenizer) as url:
        async with running_proxy([url], output) as (_, proxy):
            async with aiohttp.ClientSession() as session:
                carried = await version_workload.partial_rollouts(session, proxy, qwen_tokenizer)
    version_workload.by_sample(trajectories(output))
    rows = {r["sample_index"]: r for r in export(output, tmp_path / "rl", "rl")}
    assert sorted(rows) == [0, 1]
    resumed, whole = rows[0], rows[1]
    assert resumed["response_ids"][: len(carried)] == carried  # both attempts, one row
    assert (resumed["weight_version"], resumed["weight_versions"], resumed["version_lag"]) == (
        "4", ["3", "4"], 1)  # fmt: skip
    assert (whole["weight_version"], whole["weight_versions"], whole["version_lag"]) == (
        "4", ["4"], 1)  # fmt: skip
    for row, (low, high, latest, partial, sample_id) in (
        (resumed, version_workload.EXPECTED[0]), (whole, version_workload.EXPECTED[1])
    ):  # fmt: skip
        assert (row["weight_version_min"], row["weight_version_max"],
                row["weight_version_latest"], row["partial_rollout"], row["sample_id"]) == (
            low, high, latest, partial, sample_id)  # fmt: skip
