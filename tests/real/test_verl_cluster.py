"""verl traced on a Ray cluster of three nodes (`verl_harness/cluster.py`, in verl's venv): a
proxy beside each rollout server, one sampling decision per step across the proxies, one run
in one store, a proxy killed mid-step costing no training error, a run ended as verl ends it
(nothing stopped: Ray kills the actors) losing nothing, nothing left running.

The harness runs once per session, beside the unit tests (it takes about three minutes, most
of it Ray and verl's workers starting); each test reads what it wrote.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from trace_proxy.show import show
from trace_proxy.ui.index import StoreIndex

from .verl_run import CLUSTER_RUN

STEPS = (1, 2, 3)
KILL_STEP = 3
KEEP, N, SAMPLES = 2, 2, 4
RUNS = {"plugin": "traces-1", "rerun": "traces-2"}


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """The run's work directory and report: started with the session (verl_run.py), or here
    when nothing started it."""
    if not CLUSTER_RUN.started:
        CLUSTER_RUN.start_if_selected(request.session.items, tmp_path_factory.mktemp("cluster"))
    work = CLUSTER_RUN.wait()
    return work, json.loads((work / "cluster.json").read_text())


def records(output: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every trajectory under `output`, with the replica directory it was written to."""
    found = []
    for path in sorted((output / "replicas").glob("*/*/*/*.jsonl")):
        replica = path.parents[2]
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("record") == "trajectory":
                found.append((replica, record))
    return found


def kept(output: Path, step: int) -> dict[int, list[int]]:
    """The samples kept in a step, across every replica, with their rollouts."""
    samples: dict[int, list[int]] = {}
    for _, record in records(output):
        key = record["key"]
        if key["step"] == step and not key["validate"]:
            samples.setdefault(key["sample_index"], []).append(key["rollout_n"])
    return {sample: sorted(rollouts) for sample, rollouts in samples.items()}


def test_a_proxy_dying_mid_step_changes_nothing_verl_gets(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    """The run whose proxy was killed gets the same batches as the run that lost none: the
    calls that fell back to verl's own path returned what the proxy's would have."""
    _, report = cluster
    first, rerun = report["runs"]["plugin"], report["runs"]["rerun"]
    for step in STEPS:
        assert first[f"step{step}"] is not None, (step, first.get("killed"))
        assert first[f"step{step}"]["responses"]
        for field, value in rerun[f"step{step}"].items():
            assert first[f"step{step}"][field] == value, (step, field)
    killed = report["runs"]["plugin"]["killed"]
    assert killed["killed_while_running"] and "error" not in killed


def test_a_proxy_beside_each_rollout_server_carries_its_calls(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    work, report = cluster
    server_nodes: dict[str, str] = report["server_nodes"]
    assert len(set(server_nodes.values())) == 3  # a server on each node
    for name, traces in RUNS.items():
        proxies = report["runs"][name]["proxies"]
        assert sorted(p["node_id"] for p in proxies) == sorted(server_nodes.values())
        for proxy in proxies:  # on its node, listening where that node's server does
            [server] = proxy["servers"]
            assert server_nodes[server] == proxy["node_id"] == proxy["node_id"]
            assert proxy["proxy_url"].startswith(f"http://{server.rsplit(':', 1)[0]}:")
        found = records(work / traces)
        assert found
        for replica, record in found:
            node = next(n for n in server_nodes.values() if n[:8] in replica.name)
            for call in record["calls"]:  # written by the proxy of its server's node
                assert server_nodes[call["upstream"].removeprefix("http://")] == node
        assert len({replica for replica, _ in found}) > 1  # several proxies took part


def test_exactly_n_samples_per_step_across_the_proxies_the_same_on_a_rerun(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    work, _ = cluster
    first, rerun = (work / RUNS["plugin"]), (work / RUNS["rerun"])
    for step in STEPS:
        chosen = kept(rerun, step)
        assert len(chosen) == KEEP, (step, chosen)  # not KEEP per proxy
        assert all(rollouts == list(range(N)) for rollouts in chosen.values())
        if step != KILL_STEP:
            assert kept(first, step) == chosen  # the same samples, whole groups, once each
        else:  # what reached the killed proxy while it was down took verl's path, unrecorded
            assert set(kept(first, step)) <= set(chosen)
    # `show` and the viewer take the output's replicas as one store
    printed = io.StringIO()
    assert show(rerun, out=printed) == 0
    lines = printed.getvalue().splitlines()
    for step in STEPS:
        [summary] = [line for line in lines if line.startswith(f"-- step {step}:")]
        assert f"{SAMPLES * N} trajectories ({KEEP * N} kept, " in summary
    index = StoreIndex([rerun], min_interval=0)
    index.refresh(force=True)
    [run] = index.runs.values()
    assert sorted(run.steps) == [(False, step) for step in STEPS]
    assert all(step.summary and step.summary["trajectories_kept"] == KEEP * N
               for step in run.steps.values())  # fmt: skip


def test_a_killed_proxy_costs_no_training_error_and_nothing_is_left_running(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    work, report = cluster
    plugin = report["runs"]["plugin"]
    killed = plugin["killed"]
    victim = next(p for p in plugin["proxies"] if p["node_id"] == killed["node_id"])
    assert victim["restarts"] == 1 and victim["pid"] != killed["pid"]  # started again
    assert all(p["restarts"] == 0 for p in plugin["proxies"] if p is not victim)
    assert plugin["fallbacks"].get("proxy_unreachable", 0) >= 1  # counted, not traced
    assert report["runs"]["rerun"]["fallbacks"] == {}
    # the other proxies' records are whole: every trajectory closed by its run's end
    for replica, record in records(work / RUNS["plugin"]):
        if killed["node_id"][:8] not in replica.name:
            assert record["close_reason"] == "done" and record["calls"]
    assert report["left_running_after_shutdown"] == []


def test_an_actor_ray_restarts_starts_a_proxy_beside_the_one_still_draining(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    """A proxy's actor killed and started again by Ray while its proxy is still draining: the
    new actor's proxy writes a replica directory of its own (and listens on new ports), so the
    two never share a spool; the old one ends all the same (nothing is left running)."""
    _, report = cluster
    restarted = report["runs"]["plugin"]["actor_restarted"]
    before, after = restarted["before"], restarted["after"]
    assert after["pid"] != before["pid"]
    assert after["output"].startswith(before["output"] + "-")


def test_a_run_ended_as_verl_ends_it_has_every_steps_trajectories_closed_when_their_loop_returned(
    cluster: tuple[Path, dict[str, Any]],
) -> None:
    """Nothing stopped the proxies: Ray killed their actors (with the actors' children and
    process groups) when the run ended. Every kept trajectory of every step, the last one
    included, is in the store, closed by its agent loop's end (`done`), not by the proxy's."""
    work, _ = cluster
    for traces in RUNS.values():
        assert {record["key"]["step"] for _, record in records(work / traces)} == set(STEPS)
    rerun = records(work / RUNS["rerun"])
    assert [r["close_reason"] for _, r in rerun] == ["done"] * (KEEP * N * len(STEPS))
    for step in STEPS:
        chosen = kept(work / RUNS["rerun"], step)
        assert len(chosen) == KEEP and all(r == list(range(N)) for r in chosen.values())
