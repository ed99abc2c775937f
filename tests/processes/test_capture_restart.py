"""A trajectory that outlives its capture process reads as one rollout.

The capture process is SIGKILLed in the middle of a trajectory whose first turns it had already
written (closed when a later step began, as an asynchronous rollout outlives a weight update);
the proxy starts another, which records the turns after the kill without knowing the first
ones. `show`, the viewer (index and pages) and the SFT export each present one rollout with all
its turns, and never join two rollouts that only share a key: one the client ended (`done`)
before the kill, and one a new trajectory reuses the key of after it.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from support.proxies import metric, running_proxy, trajectories

from trace_proxy.processes.capture import CaptureProcess
from trace_proxy.show import show
from trace_proxy.store.restarts import rejoined
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import Viewer
from trace_proxy.ui.urls import trajectory_url

GUARD = 60
SPLIT = 0  # the sample whose trajectory the kill splits (keyed by step, sample and rollout)
ENDED = 1  # the sample of a rollout the client ended before the kill, then another after it
EPISODE = "episode-9"  # a trajectory keyed by its id, split the same way
OPEN = 2  # a step-2 sample whose trajectory is open at the kill: its first turn is lost


class Conversation:
    """One rollout's chat turns: each prompt is the one before, its answer and a new question."""

    def __init__(self, headers: dict[str, str], first: str) -> None:
        self.headers = {"X-Rollout-Step": "1", **headers}
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": first}]

    async def turn(
        self, session: aiohttp.ClientSession, proxy: str, then: str | None, done: bool = False
    ) -> None:
        body = {"model": "tiny-qwen", "messages": self.messages, "max_tokens": 4}
        headers = {**self.headers, **({"X-Rollout-Done": "1"} if done else {})}
        async with session.post(proxy + "/v1/chat/completions", json=body,
                                headers=headers) as response:  # fmt: skip
            assert response.status == 200
            answer = (await response.json())["choices"][0]["message"]
        self.messages = [*self.messages, {"role": "assistant", "content": answer["content"]}]
        if then is not None:
            self.messages.append({"role": "user", "content": then})


def keyed(sample: int) -> dict[str, str]:
    return {"X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0"}


async def record_across_a_kill(upstream: str, output: Path) -> dict[str, float]:
    """The store written, and what /metrics counts as dropped, by reason."""
    async with (
        running_proxy([upstream], output, step_close_grace=0.0) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        split = Conversation(keyed(SPLIT), "split one")
        episode = Conversation({"X-Rollout-Trajectory-Id": EPISODE}, "episode one")
        ended = Conversation(keyed(ENDED), "ended one")
        for turn in ("two", "three"):
            await split.turn(session, proxy, f"split {turn}")
            await episode.turn(session, proxy, f"episode {turn}")
        await ended.turn(session, proxy, None, done=True)
        # Step 2 begins: step 1's trajectories, quiet, are closed (and written) at once.
        await Conversation({"X-Rollout-Step": "2", **keyed(5)}, "next").turn(
            session, proxy, None, done=True
        )
        open_at_kill = Conversation({"X-Rollout-Step": "2", **keyed(OPEN)}, "open one")
        await open_at_kill.turn(session, proxy, "open two")
        await service.flush()
        assert capture.open_count == 1
        os.kill(capture.pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GUARD
        while capture.generation < 2 and loop.time() < deadline:
            await asyncio.sleep(0.05)  # the supervisor's restart: nothing to await from here
        await asyncio.wait_for(capture.wait_ready(), GUARD)
        await split.turn(session, proxy, "split four")
        await split.turn(session, proxy, None, done=True)
        await episode.turn(session, proxy, None, done=True)
        await Conversation(keyed(ENDED), "another rollout").turn(session, proxy, None, done=True)
        await open_at_kill.turn(session, proxy, None, done=True)
        await asyncio.wait_for(service.flush(), GUARD)
    reasons = ("capture_process_lost", "capture_process_down")
    return {r: metric(service.metrics, "trace_proxy_capture_dropped_total", reason=r)
            for r in reasons}  # fmt: skip


@pytest.fixture(scope="module")
async def recorded(
    fake_vllm: tuple[Any, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, float]]:
    output = tmp_path_factory.mktemp("restart") / "traces"
    return output, await record_across_a_kill(fake_vllm[1], output)


@pytest.fixture
def store(recorded: tuple[Path, dict[str, float]]) -> Path:
    return recorded[0]


def step_one(output: Path) -> list[dict[str, Any]]:
    return [t for t in trajectories(output) if t["key"]["step"] == 1]


def test_the_kill_split_the_records_and_marked_the_later_ones(store: Path) -> None:
    """As stored: the turns before the kill in one record, those after in another that says it
    was begun by a restarted capture process; the rollout the client ended is not marked
    continued by anything."""
    stored = step_one(store)

    def of(sample: int | None, tid: str | None = None) -> list[dict[str, Any]]:
        return [t for t in stored if (t["key"]["sample_index"], t["key"]["trajectory_id"])
                == (sample, tid)]  # fmt: skip

    for records, after in ((of(SPLIT), 2), (of(None, EPISODE), 1)):
        assert [len(t["calls"]) for t in records] == [2, after]
        assert [t["close_reason"] for t in records] == ["step_change", "done"]
        assert [t["part"] for t in records] == [1, 1]
        assert [any(a["source"] == "capture_restart" for a in t["annotations"])
                for t in records] == [False, True]  # fmt: skip
    assert [len(t["calls"]) for t in of(ENDED)] == [1, 1]
    groups = rejoined((store, t) for t in stored)
    assert sorted(len(records) for _, records in groups) == [1, 1, 2, 2]


def test_what_the_dead_process_held_open_is_counted_lost_once_and_the_rest_recorded(
    recorded: tuple[Path, dict[str, float]],
) -> None:
    """Nothing is both stored and counted, nor neither: the open trajectory's first turn is
    the one call lost; its turn after the kill is a record of its own, marked."""
    output, dropped = recorded
    assert dropped == {"capture_process_lost": 1, "capture_process_down": 0}
    [after] = [t for t in trajectories(output) if t["key"]["sample_index"] == OPEN]
    assert len(after["calls"]) == 1 and after["close_reason"] == "done"
    assert [a["source"] for a in after["annotations"]] == ["capture_restart"]
    stored = sum(len(t["calls"]) for t in trajectories(output))
    sent = 4 + 3 + 2 + 1 + 2  # split, episode, ended and its successor, step 2's, open
    assert stored + dropped["capture_process_lost"] == sent


def test_show_presents_one_rollout_with_every_turn(store: Path) -> None:
    printed = io.StringIO()
    assert show(store, step=1, out=printed) == 0
    headers = [line for line in printed.getvalue().splitlines() if line.startswith("== ")]
    assert len(headers) == 4, headers  # split, episode, and the two rollouts of ENDED
    split = [h for h in headers if f"sample {SPLIT} " in h or f"sample {SPLIT}·" in h]
    episode = [h for h in headers if f"id {EPISODE}" in h]
    ended = [h for h in headers if f"sample {ENDED}" in h]
    assert len(split) == len(episode) == 1 and len(ended) == 2
    assert " 4 calls," in split[0] and " 3 calls," in episode[0]
    assert "closed: done" in split[0] and "closed: done" in episode[0]
    assert all(" 1 calls," in h or " 1 call," in h for h in ended)
    text = printed.getvalue()
    for words in ("split one", "split two", "split three", "split four"):
        assert text.count(words) >= 1, words


async def test_the_viewer_lists_and_shows_one_rollout_with_every_turn(store: Path) -> None:
    index = StoreIndex([store], min_interval=0)
    index.refresh(force=True)
    [run] = index.runs.values()
    entries = run.steps[(False, 1)].entries
    calls = Counter((e.sample_index, e.trajectory_id, e.calls) for e in entries)
    assert calls == Counter([(SPLIT, None, 4), (None, EPISODE, 3), (ENDED, None, 1),
                             (ENDED, None, 1)])  # fmt: skip
    assert run.trajectories == 6  # the four of step 1 and step 2's two, each counted once
    assert run.steps[(False, 1)].stats.trajectories == 4
    [split] = [e for e in entries if e.sample_index == SPLIT]
    assert len(split.parts) == 2 and split.close_reason == "done"
    viewer = Viewer(index)
    async with TestClient(TestServer(viewer.app())) as client:
        for ident in (part.id for part in split.parts):  # either record's id opens it
            page = await client.get(trajectory_url(run, ident))
            assert page.status == 200
            text = await page.text()
            for words in ("split one", "split two", "split three", "split four"):
                assert words in text, words
        run_url = trajectory_url(run, split.id).rsplit("/t/", 1)[0]
        step = await (await client.get(run_url + "/step/1")).text()
        assert len(set(re.findall(r'data-id="([0-9a-f]+)"', step))) == 4


def test_the_sft_export_has_one_row_per_rollout_with_every_turn(
    store: Path, tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    from trace_proxy.dataset.build import write_dataset
    from trace_proxy.dataset.reading import Selection

    write_dataset(store, tmp_path / "sft", "sft", Selection())
    files = sorted(str(p) for p in (tmp_path / "sft").glob("*.parquet"))
    rows = [dict(r) for r in datasets.load_dataset("parquet", data_files=files, split="train")]
    rows = [r for r in rows if r["step"] == 1]
    assert len(rows) == 4
    [split] = [r for r in rows if r["sample_index"] == SPLIT]
    users = [m["content"] for m in split["messages"] if m["role"] == "user"]
    assert users == ["split one", "split two", "split three", "split four"]
    assert [m["role"] for m in split["messages"]].count("assistant") == 4
    assert sum(r["sample_index"] == ENDED for r in rows) == 2


def _record(ident: str, start: float, reason: str, since: float | None = None) -> dict[str, Any]:
    notes = [] if since is None else [{"field": "part", "source": "capture_restart",
                                       "value": since}]  # fmt: skip
    return {"record": "trajectory", "id": ident, "start": start, "end": start + 1,
            "close_reason": reason, "part": 1, "annotations": notes, "status": "ok",
            "key": {"step": 1, "trajectory_id": "t", "sample_index": 0, "rollout_n": 0},
            "calls": [], "tools": [], "summary": {"calls": 0}}  # fmt: skip


def test_only_a_marked_record_of_the_same_proxy_continues_one_the_client_did_not_end() -> None:
    from trace_proxy.store.replicas import one_per_trajectory

    here = Path("store")
    # An earlier proxy's record (before this proxy started at 100), then this proxy's.
    rerun = [(here, _record("a", 50.0, "step_change")), (here, _record("b", 120.0, "idle", 100.0))]
    assert [r["id"] for r in one_per_trajectory(rerun)] == ["a", "b"]
    ended = [(here, _record("a", 110.0, "done")), (here, _record("b", 120.0, "idle", 100.0))]
    assert [r["id"] for r in one_per_trajectory(ended)] == ["a", "b"]
    unmarked = [(here, _record("a", 110.0, "idle")), (here, _record("b", 120.0, "done"))]
    assert [r["id"] for r in one_per_trajectory(unmarked)] == ["a", "b"]  # both kept
    split = [(here, _record("a", 110.0, "idle")), (here, _record("b", 120.0, "done", 100.0))]
    [one] = one_per_trajectory(split)
    assert (one["parts"], one["close_reason"]) == (["a", "b"], "done")
    other_store = [(here, _record("a", 110.0, "idle")),
                   (Path("other"), _record("b", 120.0, "done", 100.0))]  # fmt: skip
    assert len(one_per_trajectory(other_store)) == 1  # replicas of one id: joined as before


def test_a_restarted_capture_process_marks_what_may_have_begun_in_the_dead_one() -> None:
    """Marked: a keyed trajectory first seen within the idle timeout of the restart. Not
    marked: before any restart, a later part it closed itself, one first seen after the idle
    timeout (the dead process would have closed it as idle), a key the traffic inferred."""
    from trajectories.test_assembler import Clock, call, hints, make

    from trace_proxy.trajectories.inference import TrafficInference
    from trace_proxy.trajectories.record import RESTART_SOURCE, Trajectory

    def marked(record: Any) -> bool:
        return any(note.get("source") == RESTART_SOURCE for note in record.annotations)

    clock = Clock()
    assembler, out = make(clock, inference=TrafficInference())
    assembler.add_call(hints(step=1, sample_index=0, rollout_n=0, done=1), call(0.0, [1]))
    assembler.follow_restart(since=1000.0)
    assembler.add_call(hints(step=1, sample_index=1, rollout_n=0), call(1.0, [1]))
    assembler.add_call(hints(trajectory_id="t", done=1), call(1.0, [2]))
    assembler.close_all("idle")  # sample 1 closed by the proxy: its next call is a part 2
    assembler.add_call(hints(step=1, sample_index=1, rollout_n=0, done=1), call(2.0, [1]))
    assembler.add_call(hints(), call(2.0, [7, 7]))  # keyless: its key inferred
    clock.now = 10.5  # past the idle timeout of 10
    assembler.add_call(hints(trajectory_id="late", done=1), call(11.0, [3]))
    assembler.close_all()
    stored = [t for t in out if isinstance(t, Trajectory)]

    def name(t: Trajectory) -> Any:
        tid = t.key.trajectory_id
        return "inferred" if tid and t.key.sources["trajectory_id"].startswith("inferred") else tid

    seen = {(t.key.sample_index, name(t), t.part): marked(t) for t in stored}
    assert seen == {
        (0, None, 1): False,  # before the restart
        (1, None, 1): True,
        (None, "t", 1): True,
        (1, None, 2): False,  # a part this process numbered itself
        (None, "inferred", 1): False,
        (None, "late", 1): False,  # past the idle timeout
    }
    assert [n["value"] for t in stored for n in t.annotations if marked(t)] == [1000.0, 1000.0]


def test_a_record_a_store_holds_twice_is_read_once() -> None:
    from trace_proxy.store.replicas import one_per_trajectory

    here = Path("store")
    twice = [(here, _record("a", 110.0, "idle")), (here, _record("b", 120.0, "done", 100.0)),
             (here, _record("b", 120.0, "done", 100.0))]  # fmt: skip
    [one] = one_per_trajectory(twice)
    assert one["parts"] == ["a", "b"]
    keyed = [(here, {**_record("c", 130.0, "done"), "key": {"step": 1, "sample_index": 3}})]
    assert len(one_per_trajectory(keyed * 2)) == 1


def test_a_mark_that_is_not_one_joins_nothing() -> None:
    from trace_proxy.store.restarts import restart_since

    for notes in (5, "capture_restart", [5], [{"source": "capture_restart", "value": "1"}],
                  [{"source": "capture_restart", "value": True}], None):  # fmt: skip
        assert restart_since({"annotations": notes}) is None
    assert restart_since({"annotations": [{"source": "capture_restart", "value": 7}]}) == 7.0
