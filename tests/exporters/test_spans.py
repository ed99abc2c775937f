"""The neutral span view every trace backend maps (trace_proxy/exporters/backends/spans.py):
what a user of any backend relies on is that a rollout reads as its root, its calls and its
tools, in order, under the root, at the record's times, each call with its whole prompt."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import orjson
import pytest

from trace_proxy.exporters.backends import spans
from trace_proxy.exporters.backends.spans import Generation, Root, Tool, TrajectorySpans
from trace_proxy.trajectories.prompts import share_prefixes
from trace_proxy.trajectories.record import (
    CallError,
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    ToolCall,
    Trajectory,
    dumps,
)

T0 = 1_700_000_000.123457  # a time no float holds exactly
QUESTION = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {"id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
CHATML = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
FOLLOW = "<|im_end|>\n<|im_start|>user\nAnd Oslo?<|im_end|>\n<|im_start|>assistant\n"


def chat_rollout() -> Trajectory:
    """A chat agent: the model calls a tool, gets its result, answers."""
    answer = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    result = {"role": "tool", "tool_call_id": "call-1", "content": "18 C, clear"}
    calls = [
        GenerateCall(
            index=0, dialect="openai.chat", route="/v1/chat/completions",
            upstream="http://vllm:8000", start=T0, end=T0 + 0.4, first_byte=T0 + 0.1,
            model="qwen", prompt=Prompt(messages=list(QUESTION), tools=WEATHER),
            outputs=[Output(index=0, tool_calls=[CALL], finish_reason="tool_calls")],
            usage={"prompt_tokens": 20, "completion_tokens": 8},
        ),
        GenerateCall(
            index=1, dialect="openai.chat", route="/v1/chat/completions",
            upstream="http://vllm:8000", start=T0 + 0.6, end=T0 + 1.0, model="qwen",
            prompt=Prompt(messages=[*QUESTION, answer, result], tools=WEATHER),
            outputs=[Output(index=0, text="Clear, 18 C.", finish_reason="stop")],
        ),
    ]  # fmt: skip
    share_prefixes(calls)
    assert calls[1].prompt.prefix_call == 0  # stored as a reference and the new message
    tool = ToolCall(
        index=0, observed="chat_tool_calls", start=T0 + 0.4, end=T0 + 0.6, name="get_weather",
        call_id="call-1", arguments='{"city": "Paris"}', result="18 C, clear", requested_by=0,
    )  # fmt: skip
    return Trajectory(
        id="c" * 32, key=RolloutKey(project="p", experiment="grpo", step=3, sample_index=1),
        start=T0, end=T0 + 1.0, status="ok", close_reason="done", calls=calls, tools=[tool],
        reward=1.0,
    )  # fmt: skip


def token_rollout(tokenizer: Any, answers: list[str], next_prompts: list[str]) -> Trajectory:
    """A token-in rollout decoded by token2text: each prompt the previous one, then
    `next_prompts[i]` (a re-rendered answer and the next user turn)."""
    from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
    from trace_proxy.text.toolparsers import get_parser

    prompts = [tokenizer.encode(CHATML)]
    for more in next_prompts:
        prompts.append(prompts[-1] + tokenizer.encode(more))
    calls = [
        GenerateCall(
            index=i, dialect="sglang.generate", route="/generate", upstream="http://sglang:30000",
            start=T0 + i, end=T0 + i + 0.5, prompt=Prompt(token_ids=list(ids)),
            outputs=[Output(index=0, token_ids=tokenizer.encode(answer), finish_reason="stop")],
        )
        for i, (ids, answer) in enumerate(zip(prompts, answers, strict=True))
    ]  # fmt: skip
    share_prefixes(calls)
    trajectory = Trajectory(
        id="d" * 32, key=RolloutKey(project="p", experiment="grpo"), start=T0,
        end=T0 + len(calls), status="ok", close_reason="done", calls=calls,
    )  # fmt: skip
    tokenizers = Tokenizers()
    tokenizers.add(None, decoder_for(tokenizer, skip_special_tokens=False))
    Token2Text(tokenizers, get_parser("hermes")).process([trajectory])
    return trajectory


def both_forms(trajectory: Trajectory) -> TrajectorySpans:
    """The view of the record and of its JSON form, which must be the same."""
    view = spans.trajectory_spans(trajectory)
    assert spans.trajectory_spans(orjson.loads(dumps(trajectory))) == view
    return view


def test_a_chat_tool_rollout_reads_as_root_calls_then_tools() -> None:
    trajectory = chat_rollout()
    view = both_forms(trajectory)
    spans = list(view)
    assert [s.id for s in spans] == ["root", "call/0", "call/1", "tool/0"]
    assert [s.parent for s in spans] == [None, "root", "root", "root"]
    assert [type(s) for s in spans] == [Root, Generation, Generation, Tool]
    assert [(s.start, s.end) for s in spans] == [
        (T0, T0 + 1.0), (T0, T0 + 0.4), (T0 + 0.6, T0 + 1.0), (T0 + 0.4, T0 + 0.6),
    ]  # fmt: skip

    root, (first, second), (tool,) = view.root, view.calls, view.tools
    assert root.record_id == "c" * 32 and root.status == "ok" and root.reward == 1.0
    assert root.key["step"] == 3 and root.key["sample_index"] == 1
    assert view.failed == []
    # The second call's whole prompt, though the record stores a reference and one message.
    assert second.stored_prompt["prefix_call"] == 0
    assert second.prompt["messages"] == [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, clear"},
    ]
    assert first.prompt["tools"] == second.prompt["tools"] == WEATHER
    assert first.outputs[0]["tool_calls"] == [CALL] and second.outputs[0]["text"] == "Clear, 18 C."
    assert (first.model, first.first_byte) == ("qwen", T0 + 0.1)
    assert first.usage == {"prompt_tokens": 20, "completion_tokens": 8}
    assert first.prompt_text is None and first.prompt_tokens == 0  # no token ids: nothing decoded
    assert view.prompt_ids() == [None, None]
    assert tool.name == "get_weather" and tool.call_id == "call-1"
    assert tool.arguments == '{"city": "Paris"}' and tool.parsed_arguments == {"city": "Paris"}
    assert tool.result == "18 C, clear" and tool.requested_by == 0


def test_a_token_rollout_has_each_calls_whole_prompt_decoded(qwen_tokenizer: Any) -> None:
    answers = ["Sunny.<|im_end|>", "Cold.<|im_end|>", "Done.<|im_end|>"]
    # Each prompt extends the whole context: the previous prompt and its answer.
    more = [answer + FOLLOW[len("<|im_end|>") :] for answer in answers[:2]]
    view = both_forms(token_rollout(qwen_tokenizer, answers, more))
    assert [s.id for s in view] == ["root", "call/0", "call/1", "call/2"]
    assert [s.parent for s in view] == [None, "root", "root", "root"]
    assert [(c.start, c.end) for c in view.calls] == [(T0 + i, T0 + i + 0.5) for i in range(3)]
    encode = qwen_tokenizer.encode
    whole = view.prompt_ids()
    assert whole == [encode(CHATML), encode(CHATML) + encode(more[0]),
                     encode(CHATML) + encode(more[0]) + encode(more[1])]  # fmt: skip
    assert [c.prompt_tokens for c in view.calls] == [len(ids or []) for ids in whole]
    decode = qwen_tokenizer.decode
    for call, ids in zip(view.calls, whole, strict=True):
        assert call.prompt_text == decode(ids)  # the whole prompt, not the stored piece
    later = view.calls[2]
    assert later.stored_prompt["prefix_call"] == 1
    assert later.prompt_piece is not None and later.prompt_text is not None
    assert later.prompt_text.endswith(later.prompt_piece)
    assert later.prompt_piece != later.prompt_text  # the piece is what the record stores
    assert view.root.transcript == later.prompt_text + "Done.<|im_end|>"
    assert not view.root.transcript_stored  # the pieces spell it out


def test_a_prompt_that_kept_the_turn_but_not_its_answer(qwen_tokenizer: Any) -> None:
    """A client that drops the model's thinking from the earlier turn: the next prompt is the
    earlier prompt and a re-rendered answer, so the whole text joins at that prompt; where the
    sharing stops inside an answer, nothing but the stored piece is known."""
    answers = ["<think>hm</think>Sunny.<|im_end|>", "Cold!<|im_end|>", "Done.<|im_end|>"]
    trajectory = token_rollout(
        qwen_tokenizer,
        answers,
        ["Sunny." + FOLLOW, "Cold." + FOLLOW],  # "Cold!" re-rendered
    )
    view = both_forms(trajectory)
    first, kept, rerendered = view.calls
    assert kept.stored_prompt["prefix_len"]["token_ids"] == first.prompt_tokens
    assert kept.prompt_text == qwen_tokenizer.decode(view.prompt_ids()[1])
    assert rerendered.prompt_text is None and rerendered.prompt_piece is not None
    assert view.root.transcript_stored  # token2text stores it whole: the pieces do not tell


def test_errors_and_an_unanswered_tool() -> None:
    trajectory = chat_rollout()
    trajectory.status = "error"
    trajectory.calls[1].error = CallError("http_5xx", "upstream failed")
    trajectory.calls[1].end = None
    trajectory.tools[0].end = None
    trajectory.tools[0].result = None
    trajectory.tools[0].arguments = "{not json"
    view = both_forms(trajectory)
    assert view.root.status == "error"
    assert [c.id for c in view.failed] == ["call/1"]
    assert spans.error_text(view.failed[0].error) == "http_5xx: upstream failed"
    assert spans.error_text(None) is None
    assert view.calls[1].end is None and view.tools[0].end is None
    assert view.tools[0].parsed_arguments == "{not json"  # not JSON: the text as it is


@pytest.mark.parametrize("seconds", [T0, 1_700_000_000.0, 1.5, 1_799_999_999.999999])
def test_ns_is_the_floats_exact_value_to_the_nearest_nanosecond(seconds: float) -> None:
    assert spans.ns(seconds) == int((Decimal(seconds) * 1_000_000_000).to_integral_value())
    assert spans.utc(seconds).timestamp() == pytest.approx(seconds, abs=1e-6)


def test_duration_ms() -> None:
    assert spans.duration_ms(T0, T0 + 0.25) == 250.0
    assert spans.duration_ms(T0, None) is None and spans.duration_ms(None, T0) is None
