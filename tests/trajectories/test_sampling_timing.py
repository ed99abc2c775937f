"""Top-N sampling decided right whatever the timing: a step ends after every call that arrived
before the next step's first call has been placed, never twice, and a trajectory that truly
closes after its step ended is judged against what the step kept."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from fakes import FakeVLLM
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from support.proxies import metric, running_proxy, trajectories

from trace_proxy.capture.dialects.common import new_call
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.metrics import Metrics
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.record import Record, StepSummary, Trajectory
from trace_proxy.trajectories.sampler import Policy, Sampler, sample_hash

SAMPLES, ROLLOUTS, TURNS, KEEP, SEED = 10, 4, 2, 3, 11


def top(step: int) -> set[int]:
    ranked = sorted(range(SAMPLES), key=lambda s: sample_hash(SEED, "exp", step, False, s))
    return set(ranked[:KEEP])


def rollout_headers(step: int, sample: int, rollout: int, turn: int) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Rollout-Experiment": "exp",
               "X-Rollout-Step": str(step), "X-Rollout-Sample-Index": str(sample),
               "X-Rollout-N": str(rollout)}  # fmt: skip
    if turn == TURNS - 1:
        headers["X-Rollout-Done"] = "true"
    return headers


def request_body(sample: int, rollout: int, turn: int) -> bytes:
    prompt = [sample + 1, rollout + 1] * 4 + [7] * (4 * turn)
    return orjson.dumps({"model": "tiny-qwen", "prompt": prompt, "max_tokens": 2})


def expect_one_exact_summary_per_step(summaries: list[dict[str, Any]]) -> None:
    assert sorted(s["step"] for s in summaries) == [1, 2], summaries
    for summary in summaries:
        assert summary["trajectories_seen"] == SAMPLES * ROLLOUTS
        assert summary["trajectories_kept"] == KEEP * ROLLOUTS
        assert summary["trajectories_dropped_by_sampler"] == (SAMPLES - KEEP) * ROLLOUTS
        assert summary["calls_seen"] == SAMPLES * ROLLOUTS * TURNS
        assert summary["calls_kept"] == KEEP * ROLLOUTS * TURNS


async def test_a_capture_process_behind_still_decides_each_step_with_all_its_trajectories(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    """The capture process is stopped while two steps are forwarded, one after the other (each
    call after the previous answer, the done flag on every rollout's last turn), so when it
    resumes it reads the next step's refused calls before it has placed the first step's
    trajectories. Each step still keeps its 3 samples with all their rollouts, once."""
    _, upstream = fake_vllm
    async with running_proxy([upstream], tmp_path, max_samples_per_step=KEEP, sample_seed=SEED) as (
        service,
        proxy,
    ):
        pid = service.recorder.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession() as session:
                for step in (1, 2):
                    for sample in range(SAMPLES):
                        for rollout in range(ROLLOUTS):
                            for turn in range(TURNS):
                                async with session.post(
                                    proxy + "/v1/completions",
                                    data=request_body(sample, rollout, turn),
                                    headers=rollout_headers(step, sample, rollout, turn),
                                ) as response:
                                    assert response.status == 200
                                    await response.read()
        finally:
            os.kill(pid, signal.SIGCONT)
        await service.flush()
        metrics = service.metrics
    stored = trajectories(tmp_path)
    for step in (1, 2):
        kept = [t for t in stored if t["key"]["step"] == step]
        assert {t["key"]["sample_index"] for t in kept} == top(step)
        assert len(kept) == KEEP * ROLLOUTS and all(len(t["calls"]) == TURNS for t in kept)
    summaries = [r for _, r in iter_records(tmp_path) if r.get("record") == "step_summary"]
    expect_one_exact_summary_per_step(summaries)
    # /metrics agrees with the store: every trajectory seen is kept or dropped by the sampler.
    seen = metric(metrics, "trace_proxy_sampled_total", what="trajectories", outcome="seen")
    kept_n = metric(metrics, "trace_proxy_sampled_total", what="trajectories", outcome="kept")
    assert (seen, kept_n) == (2 * SAMPLES * ROLLOUTS, len(stored))


def exchange(step: int, sample: int, rollout: int, turn: int) -> Exchange:
    response = orjson.dumps({"choices": [{"index": 0, "text": "ab", "token_ids": [7, 7],
                                          "finish_reason": "stop"}]})  # fmt: skip
    return Exchange(
        method="POST", path="/v1/completions", query="",
        request_headers=CIMultiDictProxy(CIMultiDict(rollout_headers(step, sample, rollout, turn))),
        path_metadata=[], upstream="u", start=float(step * 1000 + turn), status=200,
        request_body=request_body(sample, rollout, turn), response_chunks=[response],
    )  # fmt: skip


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[Exchange], list[int]]:
    """Two steps' calls in an order a rollout loop may send them (rollouts interleaved at
    random, each rollout's turns in order, the second step after the first), and when the
    stage is given each of them, processes one, or finishes one closed trajectory."""
    arrivals: list[Exchange] = []
    for step in (1, 2):
        turns = {(s, r): 0 for s in range(SAMPLES) for r in range(ROLLOUTS)}
        while turns:
            rollout = draw(st.sampled_from(sorted(turns)))
            arrivals.append(exchange(step, *rollout, turns[rollout]))
            turns[rollout] += 1
            if turns[rollout] == TURNS:
                del turns[rollout]
    actions = draw(st.lists(st.integers(0, 2), min_size=len(arrivals), max_size=4 * len(arrivals)))
    return arrivals, actions


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_any_timing_of_arrival_parsing_and_finishing_decides_each_step_once(
    schedule: tuple[list[Exchange], list[int]],
) -> None:
    """The sampler judges calls as they arrive; parsing lags behind by any amount, and closed
    trajectories are finished any time later: the same 3 samples per step, one summary each."""
    arrivals, actions = schedule
    out: list[Record] = []
    gate = SamplingGate(Sampler(SEED, Policy(max_samples=KEEP)), out.append)
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=600,
                          gate=gate, step_close_grace=0.0, defer_finishing=True)  # fmt: skip
    stage = CaptureStage(
        MetadataResolver([]), assembler, Metrics(), project="p", experiment="e",
        queue_size=10_000, idle_check_interval=60,
    )  # fmt: skip
    waiting = iter(arrivals)
    for action in [*actions, *[0] * len(arrivals)]:
        if action == 0:
            arrived = next(waiting, None)
            if arrived is not None and stage.admit(arrived):
                stage.submit(arrived)
        elif action == 1:
            stage.process_waiting()
        elif assembler.pending:
            assembler.run_pending(until=0.0)  # one item
    while stage.process_waiting():
        pass
    assembler.run_pending()
    assembler.close_all()
    kept = {(r.key.step, r.key.sample_index) for r in out if isinstance(r, Trajectory)}
    assert kept == {(step, s) for step in (1, 2) for s in top(step)}
    summaries = [dataclasses.asdict(r) for r in out if isinstance(r, StepSummary)]
    expect_one_exact_summary_per_step(summaries)


def test_a_trajectory_closed_after_its_step_ended_is_judged_by_what_the_step_kept() -> None:
    """Late rollouts: one of a kept sample is exported (annotated as late), one of a sample the
    step dropped is dropped; the step's summary is not written again."""
    out: list[Record] = []
    gate = SamplingGate(Sampler(SEED, Policy(max_samples=KEEP)), out.append)
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=600, gate=gate)
    resolver = MetadataResolver([])

    def send(step: int, sample: int, rollout: int) -> None:
        for turn in range(TURNS):
            ex = exchange(step, sample, rollout, turn)
            hints = resolver.resolve(ex.request_headers, [], None)
            assembler.add_call(hints, new_call(ex, "vllm.completions", {}))

    for sample in range(SAMPLES):
        send(1, sample, 0)
    send(2, 0, 0)  # step 2 starts: step 1 ends
    kept_sample = min(top(1))
    dropped_sample = min(set(range(SAMPLES)) - top(1))
    send(1, kept_sample, 1)
    send(1, dropped_sample, 1)
    assembler.close_all()
    late = [r for r in out if isinstance(r, Trajectory) and (r.key.step, r.key.rollout_n) == (1, 1)]
    assert [t.key.sample_index for t in late] == [kept_sample]
    assert any(a.get("note", "").startswith("late") for a in late[0].annotations)
    step_one = [r for r in out if isinstance(r, StepSummary) and r.step == 1]
    assert len(step_one) == 1 and step_one[0].trajectories_seen == SAMPLES
