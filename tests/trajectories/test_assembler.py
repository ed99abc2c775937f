"""Grouping of interleaved calls into trajectories, and every way a trajectory closes."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import time
import uuid

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.dialects.common import decode_request
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories import assembler as assembler_module
from trace_proxy.trajectories import versions
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.keys import KeyHints, parse_mapping
from trace_proxy.trajectories.prompts import (
    common_prefix,
    expand_prompts,
    extension,
    share_prefixes,
)
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    Record,
    StepEvent,
    StepSummary,
    Trajectory,
    dumps,
    ids_list,
    new_record_id,
)
from trace_proxy.trajectories.rewards import Outcome
from trace_proxy.trajectories.sampler import Fate, Policy, Sampler, sample_hash


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hints(**values) -> KeyHints:
    h = KeyHints()
    for name, value in values.items():
        h.offer(name, str(value), "test")
    return h


def call(
    start: float, prompt: list[int] | None = None, out: list[int] | None = None
) -> GenerateCall:
    return GenerateCall(
        index=-1, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
        start=start, end=start + 0.5, prompt=Prompt(token_ids=prompt),
        outputs=[Output(index=0, token_ids=out)] if out is not None else [],
    )  # fmt: skip


def make(clock: Clock | None = None, **kw) -> tuple[Assembler, list[Record]]:
    out: list[Record] = []
    a = Assembler(
        out.append, project="p", experiment="e", idle_timeout=10, clock=clock or Clock(), **kw
    )
    return a, out


def test_interleaved_trajectories_are_separated_and_ordered() -> None:
    assembler, out = make()
    plan = [(s, r, t) for s in range(20) for r in range(3) for t in range(4)]
    random.Random(7).shuffle(plan)
    for s, r, t in plan:
        # start times follow the turn order even though arrival is shuffled
        assembler.add_call(hints(step=1, sample_index=s, rollout_n=r), call(start=t + s * 0.001))
    assembler.close_all()
    trajectories = [r for r in out if isinstance(r, Trajectory)]
    assert len(trajectories) == 60
    for t in trajectories:
        assert [c.index for c in t.calls] == [0, 1, 2, 3]
        assert [c.start for c in t.calls] == sorted(c.start for c in t.calls)
        assert t.close_reason == "shutdown"
    assert {(t.key.sample_index, t.key.rollout_n) for t in trajectories} == {
        (s, r) for s in range(20) for r in range(3)
    }


def test_done_flag_closes_at_once_and_late_call_opens_part_two() -> None:
    assembler, out = make()
    assembler.add_call(hints(step=1, sample_index=0), call(0))
    assembler.add_call(hints(step=1, sample_index=0, done="true"), call(1))
    assert len(out) == 1 and out[0].close_reason == "done" and len(out[0].calls) == 2
    assembler.add_call(hints(step=1, sample_index=0), call(2))
    assembler.close_all()
    assert out[1].part == 2


def test_step_change_closes_older_steps_of_the_same_experiment_only() -> None:
    assembler, out = make()
    assembler.add_call(hints(experiment="a", step=1, sample_index=0), call(0))
    assembler.add_call(hints(experiment="b", step=1, sample_index=0), call(0))
    assembler.add_call(hints(experiment="a", step=1, sample_index=0, validate="true"), call(0))
    assembler.add_call(hints(experiment="a", step=2, sample_index=0), call(1))
    assert [(r.key.experiment, r.key.step, r.close_reason) for r in out] == [
        ("a", 1, "step_change")
    ]


def test_deferred_finishing_spreads_a_step_change_over_bursts_in_order() -> None:
    """A step change may close thousands of trajectories; the proxy builds and emits them a
    burst at a time (`run_pending`), in the order they closed, rather than all at once."""
    assembler, out = make(defer_finishing=True)
    for sample in range(5):
        assembler.add_call(hints(step=1, sample_index=sample), call(sample))
    assembler.add_call(hints(step=2, sample_index=0), call(10))
    assert out == [] and assembler.open_count == 1 and assembler.pending == 5
    assembler.run_pending(until=time.perf_counter() - 1)  # deadline passed: one item only
    assert [r.key.sample_index for r in out] == [0]
    # A reward for a closed trajectory still waiting to be built goes into its record, and
    # posting it finishes nothing early.
    target = {"experiment": "e", "step": 1, "sample_index": 3, "rollout_n": None}
    assert assembler.annotate(Outcome(target, reward=0.5)) == "open"
    assert assembler.pending == 4
    assembler.run_pending()
    assert [(r.key.step, r.key.sample_index) for r in out] == [(1, s) for s in range(5)]
    assert [r.reward for r in out] == [None, None, None, 0.5, None]
    assert assembler.pending == 0
    assembler.close_all()  # shutdown finishes everything at once
    assert [(r.key.step, r.close_reason) for r in out[5:]] == [(2, "shutdown")]


def test_idle_timeout() -> None:
    clock = Clock()
    assembler, out = make(clock)
    assembler.add_call(hints(trajectory_id="x"), call(0))
    clock.now = 5
    assembler.add_call(hints(trajectory_id="y"), call(0))
    clock.now = 10.5
    assembler.close_idle()
    assert [(r.key.trajectory_id, r.close_reason) for r in out] == [("x", "idle")]


def test_unkeyed_call_is_a_single_call_trajectory() -> None:
    assembler, out = make()
    assembler.add_call(KeyHints(), call(0))
    assert out[0].close_reason == "single_call" and out[0].key.experiment == "e"


def test_bound_on_open_trajectories_evicts_oldest() -> None:
    assembler, out = make(max_open=2)
    for i in range(3):
        assembler.add_call(hints(trajectory_id=f"t{i}"), call(i))
    assert [(r.key.trajectory_id, r.close_reason) for r in out] == [("t0", "evicted")]


def test_prefix_sharing_stores_suffixes_and_expands_back() -> None:
    turns = []
    context: list[int] = list(range(100))
    for turn in range(5):
        output = [1000 + turn * 10 + i for i in range(10)]
        turns.append(call(turn, prompt=list(context), out=output))
        context = context + output + [2000 + turn] * 5  # tool result tokens
    full = [list(c.prompt.token_ids or []) for c in turns]
    share_prefixes(turns)
    assert turns[0].prompt.token_ids == full[0]
    for position, turn in enumerate(turns[1:], start=1):
        assert turn.prompt.prefix_call == position - 1
        assert turn.prompt.prefix_len == {"token_ids": len(full[position]) - 5}
        assert turn.prompt.token_ids == full[position][-5:]
    stored = orjson.loads(dumps(Trajectory(
        id="x", key=None, start=0, end=1, status="ok", close_reason="done", calls=turns,  # type: ignore[arg-type]
    )))  # fmt: skip
    assert [p["token_ids"] for p in expand_prompts(stored)] == full


def test_prefix_sharing_of_chat_messages() -> None:
    first = call(0)
    first.prompt = Prompt(messages=[{"role": "user", "content": "hi"}])
    second = call(1)
    second.prompt = Prompt(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"},
        ]
    )
    share_prefixes([first, second])
    assert second.prompt.prefix_call == 0 and second.prompt.prefix_len == {"messages": 1}
    assert second.prompt.messages == [
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"},
    ]


def test_a_later_call_without_tools_does_not_inherit_them() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    first = call(0)
    first.prompt = Prompt(messages=[{"role": "user", "content": "hi"}], tools=tools)
    second = call(1)
    second.prompt = Prompt(messages=[{"role": "user", "content": "hi"},
                                     {"role": "user", "content": "again"}])  # fmt: skip
    share_prefixes([first, second])
    stored = orjson.loads(dumps(Trajectory(
        id="x", key=None, start=0, end=1, status="ok", close_reason="done",  # type: ignore[arg-type]
        calls=[first, second],
    )))  # fmt: skip
    assert [p["tools"] for p in expand_prompts(stored)] == [tools, []]


def inline_stage(
    assembler: Assembler, metrics: Metrics, resolver: MetadataResolver | None = None
) -> CaptureStage:
    """A capture stage with a budget of 1000 body bytes."""
    return CaptureStage(
        resolver or MetadataResolver([]), assembler, metrics, project="p", experiment="e",
        queue_size=100, idle_check_interval=60, queue_bytes=1000,
    )  # fmt: skip


async def test_a_body_mapping_rule_names_the_trajectory_of_a_continuing_prompt() -> None:
    """The key a request's body gives, resolved once, both finds the prompt it continues and
    files its call."""
    assembler, out = make()
    rules = [parse_mapping("body:rid=trajectory_id")]
    stage = inline_stage(assembler, Metrics(), MetadataResolver(rules))
    prompts = ([5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12])
    for start, prompt in enumerate(prompts):
        request = orjson.dumps({"rid": "t1", "prompt": prompt, "max_tokens": 1})
        response = orjson.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [9, 10],
                                              "finish_reason": "stop"}]})  # fmt: skip
        stage.submit(Exchange(
            method="POST", path="/v1/completions", query="",
            request_headers=CIMultiDictProxy(CIMultiDict()), path_metadata=[], upstream="u",
            start=float(start), status=200, request_body=request, response_chunks=[response],
        ))  # fmt: skip
    stage.start()
    await stage.drain()
    await stage.stop()
    assembler.close_all()
    [built] = [r for r in out if isinstance(r, Trajectory)]
    assert built.key.trajectory_id == "t1"
    assert built.calls[1].prompt.prefix_len == {"token_ids": 6}
    stored = orjson.loads(dumps(built))
    assert [p["token_ids"] for p in expand_prompts(stored)] == list(prompts)


async def test_capture_queue_bounds_the_body_bytes_it_holds() -> None:
    """Long prompts make each waiting exchange large: past the byte budget new exchanges are
    counted as dropped (never an unbounded queue), and the budget frees as they are parsed."""
    metrics = Metrics()
    assembler, _ = make()
    stage = inline_stage(assembler, metrics)

    def exchange(body: int) -> Exchange:
        return Exchange(
            method="POST", path="/v1/completions", query="", request_headers=CIMultiDictProxy(
                CIMultiDict()), path_metadata=[], upstream="u", start=0.0,
            request_body=b"x" * body, response_chunks=[b"y" * 100],
        )  # fmt: skip

    for body in (500, 300, 200):  # 600 + 400 fit; 300 more would exceed 1000
        stage.submit(exchange(body))
    dropped = metrics.capture_dropped.labels("capture_queue_bytes")
    assert dropped._value.get() == 1
    stage.start()
    await stage.drain()
    stage.submit(exchange(800))  # everything parsed: the budget is free again
    await stage.stop()
    assert dropped._value.get() == 1


def test_a_dropped_call_counts_in_its_trajectory_and_its_done_flag_closes_it() -> None:
    assembler, out = make()
    first = hints(step=1, sample_index=0, rollout_n=0)
    assembler.add_dropped(first, 0.5, 0.75)  # before any call: opens it
    assembler.add_call(first, call(1, [1, 2], [3]))
    assembler.add_dropped(hints(step=1, sample_index=0, rollout_n=0, done="true"), 3.0, None)
    only_dropped = hints(step=1, sample_index=1, rollout_n=0)
    assembler.add_dropped(only_dropped, 2.0, 2.5)
    assembler.add_dropped(only_dropped, 4.0, 4.25)
    assembler.add_dropped(hints(), 1.0, 1.0)  # no key: nothing to count it in
    assert assembler.open_count == 1
    assembler.close_all()
    built = {t.key.sample_index: t for t in out if isinstance(t, Trajectory)}
    assert sorted(built) == [0, 1]
    mixed, empty = built[0], built[1]
    assert mixed.close_reason == "done"
    assert (mixed.summary["calls"], mixed.summary["calls_dropped"]) == (1, 2)
    assert (mixed.start, mixed.end) == (0.5, 3.0)  # the dropped calls' times count
    # Every call dropped: still a record, so the sample is not missing from its step.
    assert (empty.close_reason, empty.calls, empty.tools) == ("shutdown", [], [])
    assert (empty.summary["calls"], empty.summary["calls_dropped"]) == (0, 2)
    assert (empty.start, empty.end, empty.status) == (2.0, 4.25, "ok")


def test_a_dropped_call_of_a_sample_the_sampler_refuses_leaves_no_record() -> None:
    out: list[Record] = []
    gate = SamplingGate(Sampler(train=Policy(rate=0.5)), out.append)
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=10,
                          clock=Clock(), gate=gate)  # fmt: skip
    policy = Sampler(train=Policy(rate=0.5))
    kept = [s for s in range(20) if policy.decide("e", 1, False, s)[0] is not Fate.DROP]
    assert 0 < len(kept) < 20
    for sample in range(20):
        assembler.add_dropped(hints(step=1, sample_index=sample, rollout_n=0, done="1"), 1.0, 2.0)
    assembler.close_all()
    gate.end_step("p", "e", False, 1)
    records = [t for t in out if isinstance(t, Trajectory)]
    assert sorted(t.key.sample_index for t in records) == kept
    assert all(t.summary["calls_dropped"] == 1 and not t.calls for t in records)
    # The step's call counts are of calls recorded or refused by the sampler: not these.
    [summary] = [r for r in out if isinstance(r, StepSummary)]
    assert (summary.calls_seen, summary.calls_kept, summary.calls_dropped_by_sampler) == (0, 0, 0)
    assert (summary.trajectories_seen, summary.trajectories_kept) == (len(kept), len(kept))


def test_a_rollout_closed_then_refused_counts_once_in_its_step() -> None:
    """Kept at first and closed (its record waits for the step's end), then pushed out by
    samples of smaller hash, then sending again: one trajectory seen, one dropped."""
    out: list[Record] = []
    sampler = Sampler(train=Policy(max_samples=1))
    gate = SamplingGate(sampler, out.append)
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=10,
                          clock=Clock(), gate=gate)  # fmt: skip
    by_hash = sorted(range(50), key=lambda s: sample_hash(0, "e", 1, False, s))
    first, smaller = by_hash[-1], by_hash[0]  # the largest hash, then one that pushes it out
    assembler.add_call(hints(step=1, sample_index=first, rollout_n=0, done="1"), call(1.0))
    assembler.add_call(hints(step=1, sample_index=smaller, rollout_n=0, done="1"), call(2.0))
    assembler.add_call(hints(step=1, sample_index=first, rollout_n=0), call(3.0))  # refused
    assembler.close_all()
    gate.end_step("p", "e", False, 1)
    kept = [t for t in out if isinstance(t, Trajectory)]
    assert [t.key.sample_index for t in kept] == [smaller]
    [summary] = [r for r in out if isinstance(r, StepSummary)]
    assert (summary.trajectories_seen, summary.trajectories_kept,
            summary.trajectories_dropped_by_sampler) == (2, 1, 1)  # fmt: skip
    assert (summary.calls_seen, summary.calls_kept, summary.calls_dropped_by_sampler) == (3, 1, 2)


async def test_an_exchange_past_the_byte_budget_leaves_a_mark_in_its_trajectory() -> None:
    """Inline capture: the dropped exchange's head still reaches its trajectory."""
    metrics = Metrics()
    assembler, out = make()
    stage = inline_stage(assembler, metrics)
    request = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 1})
    response = orjson.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})

    def turn(done: bool, padding: int) -> Exchange:
        headers = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0"}
        if done:
            headers["X-Rollout-Done"] = "1"
        return Exchange(
            method="POST", path="/v1/completions", query="",
            request_headers=CIMultiDictProxy(CIMultiDict(headers)), path_metadata=[],
            upstream="u", start=0.0, status=200, request_body=request + b" " * padding,
            response_chunks=[response],
        )  # fmt: skip

    stage.submit(turn(False, 600))
    stage.submit(turn(True, 600))  # past the budget: dropped, its done flag kept
    assert metrics.capture_dropped.labels("capture_queue_bytes")._value.get() == 1
    stage.start()
    await stage.drain()
    await stage.stop()
    trajectories = [r for r in out if isinstance(r, Trajectory)]
    assert [(t.close_reason, t.summary["calls"], t.summary["calls_dropped"])
            for t in trajectories] == [("done", 1, 1)]  # fmt: skip


small_ids = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=300, deadline=None)
@given(small_ids, st.none() | small_ids, small_ids, st.text("ab", max_size=8))
def test_a_prompt_is_compared_with_its_context_piece_by_piece_as_with_the_whole(
    prompt: list[int], output: list[int] | None, new: list[int], text: str
) -> None:
    whole = prompt + (output or [])
    assert extension(prompt, output, new) == common_prefix(whole, new)
    assert extension(whole, None, new) == common_prefix(whole, new)
    assert extension("ab", text, text + "ab") == common_prefix("ab" + text, text + "ab")


@st.composite
def arrivals(draw: st.DrawFn) -> list[GenerateCall]:
    """Calls of one trajectory in arrival order: turns that extend the last one's context,
    re-rendered (branching) prompts, text-only prompts, and starts that tie or arrive late."""
    sent: list[GenerateCall] = []
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["extends", "extends", "branches", "text"]))
        start = draw(st.integers(0, 6))
        output = draw(st.none() | st.lists(st.integers(0, 9), max_size=4))
        previous = sent[-1] if sent else None
        if kind == "text":
            made = call(start, out=output)
            made.prompt = Prompt(text=draw(st.text("ab", max_size=20)))
        elif kind == "extends" and previous is not None and previous.prompt.token_ids:
            context = previous.prompt.token_ids + (
                (previous.outputs[0].token_ids or []) if previous.outputs else []
            )
            made = call(start, context + draw(small_ids), output)
        else:
            made = call(start, draw(st.lists(st.integers(0, 9), min_size=1, max_size=12)), output)
        sent.append(made)
    return sent


# How a client may write its ids: the assembler compares the texts when it has them.
id_texts = st.sampled_from([None, ",", ", ", " , ", ",\n  "])


@settings(max_examples=400, deadline=None)
@given(
    arrivals(),
    st.lists(id_texts, min_size=7, max_size=7) | id_texts.map(lambda text: [text] * 7),
)
def test_prompt_ids_shared_as_calls_arrive_make_the_record_sharing_at_the_end_makes(
    sent: list[GenerateCall], separators: list[str | None]
) -> None:
    full = [copy.deepcopy(c) for c in sent]
    assembler, out = make()
    key = hints(step=1, sample_index=0, rollout_n=0)
    for made, separator in zip(sent, separators, strict=False):
        ids = made.prompt.token_ids
        encoded = None
        if separator is not None and ids is not None:
            # As the stage does: a prompt continuing the latest one is left as text.
            body = b'{"token_ids":[' + separator.join(map(str, ids)).encode() + b"]}"
            request, encoded = decode_request(
                body, "token_ids", lambda _: assembler.latest_prompt(key)
            )
            assert ids_list(request["token_ids"]) == ids
            made.prompt.token_ids = request["token_ids"]
        assembler.add_call(key, made, ids_text=encoded)
    assembler.close_all()
    [built] = out
    assert isinstance(built, Trajectory)
    expected = sorted(copy.deepcopy(full), key=lambda c: c.start)
    prompt_tokens = sum(len(c.prompt.token_ids or ()) for c in expected)
    share_prefixes(expected)
    line = dumps(built)
    assert b"\n" not in line  # one record, one line of the store
    stored = orjson.loads(line)
    assert [c["prompt"] for c in stored["calls"]] == [
        orjson.loads(orjson.dumps(c.prompt)) for c in expected
    ]
    assert built.summary["prompt_tokens"] == prompt_tokens
    in_order = sorted(full, key=lambda c: c.start)
    assert [p["token_ids"] for p in expand_prompts(stored)] == [
        c.prompt.token_ids for c in in_order
    ]


def test_rollouts_of_one_sample_hold_their_shared_first_prompt_once() -> None:
    """GRPO sends one first prompt to every rollout of a sample: decoded for the first, the
    others take its text as it is (one copy in memory), and every record is still exact."""
    assembler, out = make()
    first, other = b"11, 12, 13, 14", b"11, 12, 13, 15"
    texts = []
    for rollout, prompt in enumerate((first, first, other, first)):
        key = hints(step=1, sample_index=5, rollout_n=rollout)
        body = b'{"token_ids":[' + prompt + b"]}"
        request, text = decode_request(
            body, "token_ids", lambda _, k=key: assembler.latest_prompt(k)
        )
        made = call(0, None, [rollout])
        made.prompt.token_ids = request["token_ids"]
        assembler.add_call(key, made, ids_text=text)
        texts.append(text)
    assert texts[1] is texts[0] and texts[3] is texts[0]  # held once
    assert texts[2] == other
    assembler.close_all()
    stored = [orjson.loads(dumps(t)) for t in out if isinstance(t, Trajectory)]
    assert [t["calls"][0]["prompt"]["token_ids"] for t in stored] == [
        [11, 12, 13, 14], [11, 12, 13, 14], [11, 12, 13, 15], [11, 12, 13, 14],
    ]  # fmt: skip


@pytest.mark.parametrize(("budget", "kept"), [(20, 2), (1000, 3)])  # 7 bytes a prompt
def test_first_prompts_are_remembered_for_the_latest_samples_only(
    monkeypatch: pytest.MonkeyPatch, budget: int, kept: int
) -> None:
    monkeypatch.setattr(assembler_module, "FIRST_PROMPTS", 3)
    monkeypatch.setattr(assembler_module, "FIRST_PROMPTS_BYTES", budget)
    assembler, _ = make()
    texts = {sample: f"{sample}, 2, 3".encode() for sample in range(6)}  # 7 bytes each
    for sample, text in texts.items():
        made = call(0, [sample, 2, 3], [9])
        assembler.add_call(hints(step=1, sample_index=sample, rollout_n=0), made, ids_text=text)
    remembered = {
        sample: assembler.latest_prompt(hints(step=1, sample_index=sample, rollout_n=1))
        for sample in texts
    }
    assert remembered == {s: (texts[s], 3) if s >= 6 - kept else None for s in texts}


def test_a_prompt_whose_text_only_starts_like_the_last_one_is_compared_id_by_id() -> None:
    """'7, 7, 7, 1, 2' begins '7, 7, 7, 1, 23, 5', but only 4 of its 5 ids are shared."""
    assembler, out = make()
    key = hints(step=1, sample_index=0, rollout_n=0)
    prompts = ([7, 7, 7, 1, 2], [7, 7, 7, 1, 23, 5])
    for start, ids in enumerate(prompts):
        text = ", ".join(map(str, ids)).encode()
        assembler.add_call(key, call(start, list(ids), out=[]), ids_text=text)
    assembler.close_all()
    [built] = out
    assert isinstance(built, Trajectory)
    assert built.calls[1].prompt.prefix_len == {"token_ids": 4}
    stored = orjson.loads(dumps(built))
    assert [p["token_ids"] for p in expand_prompts(stored)] == list(prompts)


def test_a_resumed_generate_is_recognised_when_only_the_text_of_its_prompt_is_kept() -> None:
    """The open trajectory keeps the latest prompt as its JSON text; an abort decodes it."""
    assembler, out = make()
    key = hints(step=1, sample_index=0, rollout_n=0)
    prompt = list(range(100, 140))

    def send(start: float, ids: list[int], output: list[int], finish: str) -> None:
        made = call(start, ids, output)
        made.outputs[0].finish_reason = finish
        assembler.add_call(key, made, ids_text=", ".join(map(str, ids)).encode())

    send(0, prompt, [1, 2, 3], "abort")
    send(1, [*prompt, 1, 2, 3], [4, 5], "stop")
    send(2, [*prompt, 1, 2, 3, 4, 5, 60, 61], [6], "stop")
    assembler.close_all()
    [built] = out
    assert isinstance(built, Trajectory)
    assert [c.outputs[0].token_ids for c in built.calls] == [[1, 2, 3, 4, 5], [6]]
    assert built.calls[1].prompt.prefix_len == {"token_ids": 45}
    assert built.calls[1].prompt.token_ids == [60, 61]
    stored = orjson.loads(dumps(built))
    assert [p["token_ids"] for p in expand_prompts(stored)] == [
        prompt,
        [*prompt, 1, 2, 3, 4, 5, 60, 61],
    ]


def test_record_ids_are_uuid4_hex_and_a_forked_process_does_not_repeat_them() -> None:
    ids = {new_record_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    for text in ids:
        parsed = uuid.UUID(hex=text)
        assert (parsed.version, parsed.variant, parsed.hex) == (4, uuid.RFC_4122, text)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running any cleanup
        os.write(write, new_record_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child_id = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert len(child_id) == 32 and child_id != new_record_id()


async def test_parsing_waits_for_exchanges_to_gather_but_never_holds_up_a_waiter() -> None:
    """Once it has parsed everything, the stage lets exchanges gather before parsing again (a
    process woken for each exchange of a rollout's trickle spent a fifth more CPU per call),
    but a caller waiting for parsing (a flush, a reward's `done`, a stop) ends the wait."""
    assembler, _ = make()
    stage = CaptureStage(
        MetadataResolver([]), assembler, Metrics(), project="p", experiment="e",
        queue_size=100, idle_check_interval=60, gather=3600.0,
    )  # fmt: skip

    def exchange(start: int) -> Exchange:
        request = orjson.dumps({"prompt": [1, 2, start], "max_tokens": 1})
        response = orjson.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})
        return Exchange(
            method="POST", path="/v1/completions", query="",
            request_headers=CIMultiDictProxy(CIMultiDict()), path_metadata=[], upstream="u",
            start=float(start), status=200, request_body=request, response_chunks=[response],
        )  # fmt: skip

    stage.start()
    stage.submit(exchange(1))
    await asyncio.wait_for(stage.caught_up(), 10)  # parsed at once: nothing was waiting
    for _ in range(20):  # the worker finishes its burst and starts to gather
        await asyncio.sleep(0)
    stage.submit(exchange(2))
    stage.submit(exchange(3))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not stage.is_caught_up  # gathering: an hour, unless someone waits
    await asyncio.wait_for(stage.caught_up(), 10)
    stage.submit(exchange(4))
    await asyncio.wait_for(stage.stop(), 10)
    assert stage.is_caught_up


async def test_a_call_resumed_across_a_weight_sync_keeps_each_attempt_with_its_version() -> None:
    """verl's partial rollout, as its plugin sends it: an attempt aborted at a sync on version
    3, re-sent with the tokens it had, finished on version 4. One call, its attempts in order
    with the version each ran on (from X-Rollout-Weight-Version: vLLM's /v1/completions
    reports none), the tokens each carried over and generated and why each stopped; the
    trajectory's sample id, oldest and newest version, and the partial-rollout flag."""
    assembler, out = make()
    stage = inline_stage(assembler, Metrics())
    prompt = [5, 6, 7, 8]
    attempts = ((prompt, [9, 10, 11], "abort", "3"), ([*prompt, 9, 10, 11], [12], "stop", "4"))
    for start, (ids, generated, finish, version) in enumerate(attempts):
        request = orjson.dumps({"prompt": ids, "max_tokens": 8, "return_token_ids": True})
        response = orjson.dumps(
            {
                "id": f"cmpl-{start}",
                "choices": [
                    {"index": 0, "text": "", "token_ids": generated, "finish_reason": finish}
                ],
            }
        )
        headers = {"X-Rollout-Step": "2", "X-Rollout-Sample-Index": "7", "X-Rollout-N": "0",
                   "X-Rollout-Trajectory-Id": "t1", "X-Rollout-Sample-Id": "uid-7",
                   "X-Rollout-Weight-Version": version}  # fmt: skip
        stage.submit(Exchange(
            method="POST", path="/v1/completions", query="",
            request_headers=CIMultiDictProxy(CIMultiDict(headers)), path_metadata=[],
            upstream="u", start=float(start), end=start + 0.5, status=200, request_body=request,
            response_chunks=[response],
        ))  # fmt: skip
    stage.start()
    await stage.drain()
    await stage.stop()
    assembler.close_all()
    [built] = [r for r in out if isinstance(r, Trajectory)]
    [merged] = built.calls
    assert merged.outputs[0].token_ids == [9, 10, 11, 12]
    assert merged.weight_version == "4"
    assert [(s["weight_version"], s["carried_tokens"], s["tokens"], s["finish_reason"],
             s["request_id"]) for s in merged.segments or []] == [
        ("3", 0, 3, "abort", "cmpl-0"), ("4", 3, 1, "stop", "cmpl-1")]  # fmt: skip
    assert built.key.sample_id == "uid-7"
    assert built.key.sources["sample_id"] == "header:X-Rollout-Sample-Id"
    assert (built.weight_version_min, built.weight_version_max) == ("3", "4")
    assert built.partial_rollout is True
    assert built.weight_versions == ["4"]


def test_versions_compare_as_numbers_and_a_trajectory_on_one_version_is_not_partial() -> None:
    assembler, out = make()
    key = hints(step=1, sample_index=0, rollout_n=0)
    for start, version in enumerate(("9", "10", "10")):
        made = call(float(start), [start, 1, 2], [3])
        made.weight_version = version
        assembler.add_call(key, made)
    assembler.close_all()
    [built] = [r for r in out if isinstance(r, Trajectory)]
    assert (built.weight_version_min, built.weight_version_max, built.partial_rollout) == (
        "9", "10", True)  # fmt: skip
    assembler, out = make()
    made = call(0.0, [1, 2], [3])
    made.weight_version = "v2"
    assembler.add_call(key, made)
    assembler.close_all()
    [built] = [r for r in out if isinstance(r, Trajectory)]
    assert (built.weight_version_min, built.weight_version_max, built.partial_rollout) == (
        "v2", "v2", False)  # fmt: skip


def test_a_trajectory_keeps_the_newest_version_its_run_had_seen_when_it_closed() -> None:
    """How stale a rollout already was when it closed: the newest version seen in any call or
    weight update of its run by then (later ones not counted), by value for integers; an
    update naming no run (the proxy's own run, as a trainer without run headers sends it) is
    the server's, counted for every run, while one naming another run stays there."""
    assembler, out = make()
    old, fresh = hints(step=1, sample_index=0, rollout_n=0), hints(step=1, sample_index=1,
                                                                   rollout_n=0)  # fmt: skip
    for start, (key, version) in enumerate(((old, "9"), (fresh, "10"), (fresh, "11"))):
        made = call(float(start), [start, 1, 2], [3])
        made.weight_version = version
        assembler.add_call(key, made)
    assembler.add_event(StepEvent("weight_update", "/update_weights", "u", 3.0, "p", "e",
                                  weight_version="12"))  # fmt: skip
    assembler.add_event(StepEvent("weight_update", "/update_weights", "u", 3.0, "p", "other",
                                  weight_version="40"))  # fmt: skip
    assembler.add_call(old, call(4.0, [0, 1, 2, 3], [4]))  # a call that reports no version
    assembler.end(old)
    later = call(5.0, [9, 9], [1])
    later.weight_version = "13"
    assembler.add_call(hints(step=1, sample_index=2, rollout_n=0), later)
    assembler.close_all()
    built = {t.key.sample_index: t for t in out if isinstance(t, Trajectory)}
    assert (built[0].weight_version_max, built[0].weight_version_latest) == ("9", "12")
    assert (built[1].weight_version_max, built[1].weight_version_latest) == ("11", "13")
    assert orjson.loads(dumps(built[0]))["weight_version_latest"] == "12"
    assert versions.lag(orjson.loads(dumps(built[0]))) == 3
    assert versions.spread(orjson.loads(dumps(built[1]))) == 1


def test_versions_that_are_not_numbers_are_newer_as_they_come() -> None:
    assert versions.newer("v9", "v10") == "v10"
    assert versions.newer("10", "9") == "10"
    assert versions.newer(None, "v1") == "v1"
    assert versions.distance("v1", "v2") is None
    assert versions.distance("v1", "v1") == 0
    assert versions.distance("3", "5") == 2
