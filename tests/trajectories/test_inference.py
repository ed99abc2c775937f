"""Trajectories recovered from traffic alone: continuation, groups, steps, resume, bounds."""

from __future__ import annotations

from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    Record,
    StepEvent,
    Trajectory,
)


def call(
    start: float,
    prompt: list[int] | None = None,
    out: list[int] | None = None,
    finish: str = "stop",
    messages: list[dict] | None = None,
    text: str | None = None,
    version: str | None = None,
) -> GenerateCall:
    return GenerateCall(
        index=-1, dialect="sglang.generate", route="/generate", upstream="u", start=start,
        end=start + 0.1, prompt=Prompt(token_ids=prompt, messages=messages),
        outputs=[Output(index=0, token_ids=out, text=text, finish_reason=finish)],
        weight_version=version,
    )  # fmt: skip


def assembler() -> tuple[Assembler, list[Record], list[int]]:
    out: list[Record] = []
    evicted: list[int] = []
    inference = TrafficInference(max_contexts=1000, on_evict=lambda: evicted.append(1))
    a = Assembler(out.append, project="p", experiment="e", idle_timeout=60, inference=inference)
    return a, out, evicted


def trajectories(out: list[Record]) -> list[Trajectory]:
    return [r for r in out if isinstance(r, Trajectory)]


def test_token_continuations_and_groups() -> None:
    a, out, _ = assembler()
    first = list(range(100, 140))
    # one sample, two rollouts with different answers, two turns each, interleaved
    a.add_call(KeyHints(), call(0, first, [1, 2, 3]))
    a.add_call(KeyHints(), call(0.01, first, [7, 8]))
    a.add_call(KeyHints(), call(1, [*first, 7, 8, 50, 51], [9]))
    a.add_call(KeyHints(), call(1.01, [*first, 1, 2, 3, 50, 51], [4]))
    a.add_call(KeyHints(), call(2, list(range(500, 540)), [5]))  # another sample
    a.close_all()
    recorded = trajectories(out)
    assert sorted(len(t.calls) for t in recorded) == [1, 2, 2]
    pair = [t for t in recorded if len(t.calls) == 2]
    assert {t.key.sample_hash for t in pair} == {pair[0].key.sample_hash}
    assert sorted(t.key.rollout_n or 0 for t in pair) == [0, 1]
    for t in pair:
        assert t.calls[1].prompt.prefix_call == 0  # the continuation also shares its prefix
        assert t.key.sources["trajectory_id"] == "inferred:new"
        assert t.key.sources["sample_hash"] == "inferred:first_prompt"
    lonely = next(t for t in recorded if len(t.calls) == 1)
    assert lonely.key.sample_hash != pair[0].key.sample_hash


def test_chat_continuation_matches_the_assistant_turn() -> None:
    a, out, _ = assembler()
    system = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "weather?"}
    tool_call = {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turn1 = call(0, messages=[system, user])
    turn1.outputs[0].tool_calls = [tool_call]
    other = call(0.01, messages=[system, user], text="no tools needed")
    a.add_call(KeyHints(), turn1)
    a.add_call(KeyHints(), other)
    resent = {**tool_call, "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    turn2 = call(
        1,
        messages=[system, user, {"role": "assistant", "content": None, "tool_calls": [resent]},
                  {"role": "tool", "tool_call_id": "c1", "content": "18C"}],
    )  # fmt: skip
    a.add_call(KeyHints(), turn2)
    a.close_all()
    [with_tool] = [t for t in trajectories(out) if len(t.calls) == 2]
    assert with_tool.calls[0].outputs[0].tool_calls == [tool_call]
    [span] = with_tool.tools
    assert (span.name, span.result, span.requested_by) == ("get_weather", "18C", 0)


def test_weight_updates_and_new_versions_start_new_steps() -> None:
    a, out, _ = assembler()
    a.add_call(KeyHints(), call(0, list(range(20)), [1]))
    a.add_event(StepEvent(event="weight_update", route="/update_weights_from_distributed",
                          upstream="u", time=1, project="p", experiment="e"))  # fmt: skip
    a.add_event(StepEvent(event="weight_update_finish", route="/finish_weight_update",
                          upstream="u", time=1, project="p", experiment="e"))  # fmt: skip
    a.add_call(KeyHints(), call(2, list(range(20, 40)), [1], version="v1"))
    a.add_call(KeyHints(), call(3, list(range(40, 60)), [1], version="v2"))
    a.close_all()
    steps = sorted(t.key.step or 0 for t in trajectories(out))
    assert steps == [0, 1, 2]
    first_step = min(trajectories(out), key=lambda t: t.key.step or 0)
    assert first_step.close_reason == "step_change"
    assert first_step.key.sources["step"] == "inferred:weight_updates"


def test_a_resumed_generate_is_merged_into_one_call() -> None:
    a, out, _ = assembler()
    prompt = list(range(30))
    a.add_call(KeyHints(), call(0, prompt, [1, 2, 3], finish="abort"))
    a.add_call(KeyHints(), call(1, [*prompt, 1, 2, 3], [4, 5], finish="stop"))
    a.add_call(KeyHints(), call(2, [*prompt, 1, 2, 3, 4, 5, 60, 61], [6]))  # next turn
    a.close_all()
    [t] = trajectories(out)
    assert len(t.calls) == 2
    merged = t.calls[0]
    assert merged.outputs[0].token_ids == [1, 2, 3, 4, 5]
    assert merged.outputs[0].finish_reason == "stop"
    assert [s["finish_reason"] for s in merged.segments or []] == ["abort", "stop"]


def test_headers_win_over_inference() -> None:
    a, out, _ = assembler()
    hints = KeyHints()
    hints.offer("trajectory_id", "given", "header:X-Rollout-Trajectory-Id")
    a.add_call(hints, call(0, list(range(20)), [1]))
    a.close_all()
    [t] = trajectories(out)
    assert t.key.trajectory_id == "given" and t.key.sample_hash is None


def test_state_is_bounded_and_evictions_are_counted() -> None:
    out: list[Record] = []
    evicted: list[int] = []
    inference = TrafficInference(max_contexts=10, on_evict=lambda: evicted.append(1))
    a = Assembler(out.append, project="p", experiment="e", idle_timeout=60, inference=inference)
    for i in range(25):
        a.add_call(KeyHints(), call(i, [i] * 20, [1]))
    assert len(evicted) == 15


class Words:
    """A decoder over a made-up vocabulary: id i is the word `w<i> `."""

    @staticmethod
    def decode(ids: object) -> str:
        return "".join(f"w{i} " for i in ids)  # type: ignore[attr-defined]


def text_call(start: float, prompt: list[int], reply: str) -> GenerateCall:
    """A completions call answered with text only (no token ids), as skyrl-train's remote
    engine asks for them."""
    return call(start, prompt, None, text=reply)


def _text_group(a: Assembler, first: list[int], replies: list[str]) -> None:
    for n, reply in enumerate(replies):
        a.add_call(KeyHints(), text_call(n * 0.01, first, reply))


def test_a_text_only_continuation_goes_to_the_rollout_whose_reply_it_carries() -> None:
    from trace_proxy.text.token2text import Tokenizers

    tokenizers = Tokenizers()
    tokenizers.add(None, Words.decode)
    out: list[Record] = []
    inference = TrafficInference(tokenizers=tokenizers)
    a = Assembler(out.append, project="p", experiment="e", idle_timeout=60, inference=inference)
    first = list(range(100, 140))
    _text_group(a, first, ["w7 w8 ", "w1 w2 ", "w3 ", "w5 w6 "])
    # turn 2 of the third rollout: prompt + its reply re-tokenized + the environment's ids
    a.add_call(KeyHints(), text_call(1, [*first, 3, 60, 61], "w9 "))
    a.close_all()
    recorded = trajectories(out)
    [two] = [t for t in recorded if len(t.calls) == 2]
    assert two.calls[0].outputs[0].text == "w3 "
    assert two.key.rollout_n == 2
    assert len(recorded) == 4


def test_an_ambiguous_continuation_starts_a_marked_trajectory_of_its_own() -> None:
    """No tokenizer to tell the group's rollouts apart: never guess."""
    a, out, _ = assembler()
    first = list(range(100, 140))
    _text_group(a, first, ["w7 w8 ", "w1 w2 ", "w3 ", "w5 w6 "])
    a.add_call(KeyHints(), text_call(1, [*first, 3, 60, 61], "w9 "))
    a.close_all()
    recorded = trajectories(out)
    assert sorted(len(t.calls) for t in recorded) == [1, 1, 1, 1, 1]
    [marked] = [t for t in recorded if t.calls[0].outputs[0].text == "w9 "]
    assert marked.key.sources["trajectory_id"] == "inferred:ambiguous"
    assert marked.key.rollout_n is None
    group = {t.key.sample_hash for t in recorded}
    assert len(group) == 1  # still of the sample all the candidates share


def test_identical_replies_are_ambiguous_even_with_token_ids() -> None:
    a, out, _ = assembler()
    first = list(range(100, 140))
    a.add_call(KeyHints(), call(0, first, [1, 2]))
    a.add_call(KeyHints(), call(0.01, first, [1, 2]))
    a.add_call(KeyHints(), call(1, [*first, 1, 2, 50], [4]))
    a.close_all()
    recorded = trajectories(out)
    assert sorted(len(t.calls) for t in recorded) == [1, 1, 1]
    assert any(t.key.sources["trajectory_id"] == "inferred:ambiguous" for t in recorded)


def test_a_mapped_trajectory_id_only_fixes_the_grouping() -> None:
    a, out, _ = assembler()
    first = list(range(100, 140))

    def mapped(session: str) -> KeyHints:
        hints = KeyHints()
        hints.offer("trajectory_id", session, "map:header:X-Session-ID=trajectory_id")
        return hints

    a.add_call(mapped("s0"), call(0, first, [1, 2]))
    a.add_call(mapped("s1"), call(0.01, first, [3]))
    a.add_event(StepEvent(event="weight_update", route="/update_weights", upstream="u",
                          time=1, project="p", experiment="e"))  # fmt: skip
    # a turn of s0 after the update keeps its step; the new session starts step 1
    a.add_call(mapped("s0"), call(2, [9, 9, 9], [4]))  # mapped: grouped whatever its prompt
    a.add_call(mapped("s2"), call(3, list(range(300, 340)), [5]))
    a.close_all()
    by_id = {t.key.trajectory_id: t for t in trajectories(out)}
    assert len(by_id["s0"].calls) == 2
    assert [by_id[s].key.step for s in ("s0", "s1", "s2")] == [0, 0, 1]
    assert by_id["s0"].key.sample_hash == by_id["s1"].key.sample_hash is not None
    assert by_id["s2"].key.sample_hash not in (None, by_id["s0"].key.sample_hash)
    assert [by_id[s].key.rollout_n for s in ("s0", "s1", "s2")] == [0, 1, 0]
    sources = by_id["s0"].key.sources
    assert sources["trajectory_id"].startswith("map:")
    assert (sources["step"], sources["sample_hash"], sources["rollout_n"]) == (
        "inferred:weight_updates",
        "inferred:first_prompt",
        "inferred:order_in_group",
    )
