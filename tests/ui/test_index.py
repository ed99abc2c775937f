"""The viewer's data layer: an index by file and offset that follows a growing store and
applies rewards posted after their trajectory was written."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from fakes import FakeVLLM
from support.proxies import running_proxy
from support.stores import annotation, append, call, line, run_dir, step_file, trajectory
from trajectories.test_rewards import generate, key, reward

from trace_proxy.ui import views
from trace_proxy.ui.index import StoreIndex


def test_entries_point_at_their_lines_and_sum_their_step(tmp_path: Path) -> None:
    directory = run_dir(tmp_path, "proj", "exp")
    records = [
        trajectory(sample=s, rollout=n, reward=float(s + n), calls=[call(0, "a"), call(1, "b")])
        for s in range(3)
        for n in range(2)
    ]
    append(step_file(directory, 1), *records)
    append(step_file(directory, 1, validate=True), trajectory(validate=True, reward=0.5))
    summary = {"record": "step_summary", "step": 1, "validate": False,
               "trajectories_seen": 9, "trajectories_kept": 6}  # fmt: skip
    append(directory / "steps.jsonl", summary)
    index = StoreIndex([tmp_path])
    index.refresh(force=True)

    (run,) = index.runs.values()
    assert (run.project, run.experiment, run.trajectories) == ("proj", "exp", 7)
    step = run.steps[(False, 1)]
    assert [index.read_line(e) for e in step.entries] == [line(r)[:-1] for r in records]
    assert index.read_record(step.entries[3])["id"] == records[3]["id"]
    assert step.stats.trajectories == 6 and step.stats.turns == 12
    assert step.stats.reward_mean == pytest.approx(1.5)  # rewards 0,1,1,2,2,3
    assert step.summary is not None and step.summary["trajectories_seen"] == 9
    assert run.steps[(True, 1)].stats.reward_mean == 0.5
    groups = views.groups_of(step.entries)
    assert [g.name for g in groups] == ["sample 0", "sample 1", "sample 2"]
    assert [e.rollout_n for e in groups[1].rollouts] == [0, 1]
    assert groups[1].best is groups[1].rollouts[1] and groups[1].worst is groups[1].rollouts[0]


def test_a_growing_store_is_followed_line_by_line(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    first = trajectory(sample=0)
    append(step_file(directory, 1), first)
    index = StoreIndex([tmp_path])
    before = index.refresh(force=True)
    run = next(iter(index.runs.values()))

    # Half a line (a writer mid-write) is not read; once its newline is there, it is.
    second = trajectory(sample=1)
    text = line(second)
    append(step_file(directory, 1), raw=text[:40])
    index.refresh(force=True)
    assert run.trajectories == 1
    append(step_file(directory, 1), raw=text[40:])
    assert index.refresh(force=True) > before
    assert [e.id for e in run.steps[(False, 1)].entries] == [first["id"], second["id"]]

    # A new step file and a new experiment appear without a new index.
    append(step_file(directory, 2), trajectory(step=2))
    other = run_dir(tmp_path, "proj", "other/exp")
    append(step_file(other, 1), trajectory(experiment="other/exp"))
    index.refresh(force=True)
    assert (False, 2) in run.steps
    assert {r.experiment for r in index.runs.values()} == {"exp", "other/exp"}

    # A file replaced by another (a store written again) is read again from its start.
    replacement = trajectory(sample=7)
    path = step_file(directory, 1)
    path.with_suffix(".new").write_bytes(line(replacement))
    os.replace(path.with_suffix(".new"), path)
    index.refresh(force=True)
    assert [e.id for e in run.steps[(False, 1)].entries] == [replacement["id"]]
    assert (False, 2) in run.steps


def test_refreshes_closer_than_the_interval_read_nothing(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    index = StoreIndex([tmp_path], min_interval=3600)
    index.refresh()
    append(step_file(directory, 1), trajectory())
    index.refresh()
    assert next(iter(index.runs.values())).trajectories == 0  # not looked at again yet
    index.refresh(force=True)
    assert next(iter(index.runs.values())).trajectories == 1


def test_rewards_posted_later_replace_the_stored_ones(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    a, b = trajectory(sample=0, reward=0.0), trajectory(sample=1, reward=None)
    append(step_file(directory, 1), a, b)
    index = StoreIndex([tmp_path])
    index.refresh(force=True)
    run = next(iter(index.runs.values()))
    assert run.steps[(False, 1)].stats.reward_mean == 0.0

    append(step_file(directory, 1), annotation([a["id"], b["id"]], 1.0, labels={"ok": True}))
    index.refresh(force=True)
    stats = run.steps[(False, 1)].stats
    assert (stats.rewarded, stats.reward_mean) == (2, 1.0)
    entry = run.by_id[a["id"]]
    assert entry.annotated and entry.reward == 1.0
    record = index.read_record(entry)
    assert record["reward"] == 1.0 and record["labels"] == {"ok": True}

    # A note naming a trajectory not read yet waits for it.
    late = trajectory(sample=2, reward=0.0)
    append(step_file(directory, 1), annotation([late["id"]], 0.75))
    index.refresh(force=True)
    append(step_file(directory, 1), late)
    index.refresh(force=True)
    assert run.by_id[late["id"]].reward == 0.75


def test_bad_lines_are_counted_and_links_are_not_followed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    directory = run_dir(store)
    append(step_file(directory, 1), trajectory(), raw=b'not json\n[1, 2]\n{"record": 1}\n')
    outside = run_dir(tmp_path / "elsewhere", "secret", "exp")
    append(step_file(outside, 1), trajectory(project="secret"))
    (store / "linked").symlink_to(tmp_path / "elsewhere" / "secret", target_is_directory=True)
    (directory / "step-000009.jsonl").symlink_to(step_file(outside, 1))
    named = store / "named" / "exp"
    named.mkdir(parents=True)
    (tmp_path / "secret-name").write_text('"secret"')
    (store / "named" / ".trace-proxy-name").symlink_to(tmp_path / "secret-name")
    append(step_file(named, 1), trajectory(project="named"))
    index = StoreIndex([store])
    index.refresh(force=True)
    run, other = index.runs[(0, "proj", "exp")], index.runs[(0, "named", "exp")]
    assert run.project == "proj" and run.unreadable == 2 and run.trajectories == 1
    assert (False, 9) not in run.steps
    assert len(index.runs) == 2 and other.project == "named"  # its name file is a link


def test_search_matches_text_as_the_store_writes_it(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    quoted = trajectory(sample=0, calls=[call(0, 'she said "Bonjour" — «ça va»\n')])
    plain = trajectory(sample=1, calls=[call(0, "nothing here")])
    append(step_file(directory, 1), quoted, plain)
    index = StoreIndex([tmp_path])
    index.refresh(force=True)
    entries = next(iter(index.runs.values())).steps[(False, 1)].entries
    assert index.search(entries, '"bonjour"') == {quoted["id"]}
    assert index.search(entries, "«ÇA VA»") == {quoted["id"]}
    assert index.search(entries, 'said "Bonjour" — «ça va»\n') == {quoted["id"]}
    assert index.search(entries, "absent") == set()


def test_first_divergence_of_siblings() -> None:
    same = [call(0, "The answer is 4", output_ids=[1, 2, 3, 4])]
    one = views.trajectory_view(trajectory(calls=[*same, call(1, "done.", output_ids=[5])]))
    two = views.trajectory_view(trajectory(calls=[*same, call(1, "dune!", output_ids=[6])]))
    three = views.trajectory_view(trajectory(calls=same))
    found = views.first_divergence([one, two])
    assert found == views.Divergence(turn=1, where="response", chars=1, tokens=0)
    assert views.first_divergence([one, three]) == views.Divergence(1, "length", 0, None)
    assert views.first_divergence([one, one]) is None


def test_special_tokens_are_marked_and_everything_escaped() -> None:
    shown = str(views.marked("<|im_start|>user\n<b>hi</b><tool_call>{}</tool_call><|im_end|>"))
    assert shown == (
        '<span class="special">&lt;|im_start|&gt;</span>user\n&lt;b&gt;hi&lt;/b&gt;'
        '<span class="special">&lt;tool_call&gt;</span>{}'
        '<span class="special">&lt;/tool_call&gt;</span>'
        '<span class="special">&lt;|im_end|&gt;</span>'
    )


async def test_the_index_follows_a_running_proxy_and_its_late_rewards(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, step_close_grace=0) as (service, proxy):
        assert service.addresses is not None and service.addresses.admin is not None
        index = StoreIndex([tmp_path])
        await generate(proxy, key(1, 0, 0))
        await generate(proxy, key(1, 0, 1))
        await generate(proxy, key(2, 0, 0))  # step 1 ends: its trajectories are written
        await service.flush()
        index.refresh(force=True)
        (run,) = index.runs.values()
        assert run.experiment == "exp" and run.steps[(False, 1)].stats.trajectories == 2
        assert await reward(service.addresses.admin, reward=1.0, experiment="exp", step=1,
                            sample_index=0, rollout_n=1) == "exported"  # fmt: skip
        await generate(proxy, key(3, 0, 0))
        await service.flush()
        index.refresh(force=True)
        entries = {e.rollout_n: e for e in run.steps[(False, 1)].entries}
        assert entries[1].reward == 1.0 and entries[1].annotated and entries[0].reward is None
        assert (False, 2) in run.steps
        assert orjson.loads(index.read_line(entries[0]))["key"]["rollout_n"] == 0
