"""Tool spans: chat tool_calls matched to tool results, and HTTP tool servers routed through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from fakes import FakeVLLM
from support.proxies import running_proxy, scripted_upstream, trajectories

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_chat_tool_calls_become_spans_with_results_and_agent_time(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    headers = {"X-Rollout-Trajectory-Id": "chat-tools"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    async with running_proxy([upstream], tmp_path) as (_, proxy):
        async with aiohttp.ClientSession(headers=headers) as session:
            body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS}
            async with session.post(proxy + "/v1/chat/completions", json=body) as response:
                message = (await response.json())["choices"][0]["message"]
            calls = message["tool_calls"]
            assert calls, "the fake answers a first turn with tools by calling one"
            results = [f"Error when executing tool: {c['id']} failed" if i else '{"temp_c": 18}'
                       for i, c in enumerate(calls)]  # fmt: skip
            messages += [message] + [
                {"role": "tool", "tool_call_id": c["id"], "content": r}
                for c, r in zip(calls, results, strict=True)
            ]
            body = {"model": "tiny-qwen", "messages": messages, "tools": TOOLS}
            async with session.post(proxy + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
    [trajectory] = trajectories(tmp_path)
    first, second = trajectory["calls"]
    spans = [s for s in trajectory["tools"] if s["requested_by"] == 0]
    later = [s for s in trajectory["tools"] if s["requested_by"] == 1]
    assert all(s["result"] is None and s["end"] is None for s in later)  # never answered
    assert [s["call_id"] for s in spans] == [c["id"] for c in calls]
    assert [s["result"] for s in spans] == results
    for span, tool_call in zip(spans, calls, strict=True):
        assert span["observed"] == "chat_tool_calls"
        assert span["name"] == tool_call["function"]["name"]
        assert span["arguments"] == tool_call["function"]["arguments"]
        assert (span["start"], span["end"]) == (first["end"], second["start"])
        assert span["requested_by"] == 0
    assert spans[0]["error"] is None
    assert all(s["error"]["type"] == "tool_error" for s in spans[1:])
    assert trajectory["summary"]["tool_calls"] == len(calls) + len(later)


async def test_http_tool_server_calls_are_spans_of_their_trajectory(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    seen: list[tuple[str, bytes]] = []

    async def sandbox(request: web.Request) -> web.StreamResponse:
        seen.append((request.raw_path, await request.read()))
        return web.json_response({"stdout": "42\n", "exit_code": 0})

    key = {"X-Rollout-Step": "2", "X-Rollout-Sample-Index": "5", "X-Rollout-N": "1"}
    async with (
        scripted_upstream(sandbox) as tool_server,
        running_proxy([upstream], tmp_path, tool_route=[f"sandbox={tool_server}"]) as (_, proxy),
        aiohttp.ClientSession(headers=key) as session,
    ):
        async with session.post(
            proxy + "/v1/completions",
            json={"model": "tiny-qwen", "prompt": "print(6*7)", "max_tokens": 4},
        ) as response:
            assert response.status == 200
        code = {"code": "print(6*7)", "language": "python"}
        async with session.post(proxy + "/sandbox/run_code?timeout=5", json=code) as response:
            assert await response.json() == {"stdout": "42\n", "exit_code": 0}
    assert seen == [("/run_code?timeout=5", b'{"code": "print(6*7)", "language": "python"}')]
    [trajectory] = trajectories(tmp_path)
    assert (trajectory["key"]["step"], trajectory["key"]["sample_index"]) == (2, 5)
    [span] = trajectory["tools"]
    assert span["observed"] == "http_tool_server"
    assert (span["name"], span["route"], span["http_status"]) == ("sandbox", "/run_code", 200)
    assert span["upstream"] == tool_server
    assert span["arguments"] == '{"code": "print(6*7)", "language": "python"}'
    assert span["result"] == '{"stdout": "42\\n", "exit_code": 0}'
    assert len(trajectory["calls"]) == 1


def test_text_tool_spans_from_token_ids_even_when_the_turn_is_re_rendered(
    qwen_tokenizer: Any,
) -> None:
    from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
    from trace_proxy.text.toolparsers import get_parser
    from trace_proxy.trajectories.record import GenerateCall, Output, Prompt, RolloutKey, Trajectory

    encode = qwen_tokenizer.encode
    prompt = encode(
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )
    said = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>"
    )
    # The agent re-renders the assistant turn with other spacing before adding the results.
    rerendered = said.replace('{"city": "Oslo"}', '{"city":"Oslo"}')
    results = (
        "\n<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n"
        "Error when executing tool: timeout\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    first = GenerateCall(
        index=0, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
        start=0.0, end=1.0, prompt=Prompt(token_ids=prompt),
        outputs=[Output(index=0, token_ids=encode(said))],
    )  # fmt: skip
    second = GenerateCall(
        index=1, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
        start=3.0, end=4.0, prompt=Prompt(token_ids=prompt + encode(rerendered + results)),
        outputs=[Output(index=0, token_ids=encode("Paris is warmer.<|im_end|>"))],
    )  # fmt: skip
    trajectory = Trajectory(
        id="t", key=RolloutKey(project="p", experiment="e"), start=0.0, end=4.0, status="ok",
        close_reason="done", calls=[first, second],
    )  # fmt: skip
    tokenizers = Tokenizers()
    tokenizers.add(None, decoder_for(qwen_tokenizer, skip_special_tokens=False))
    Token2Text(tokenizers, get_parser("hermes")).process([trajectory])
    spans = trajectory.tools
    assert [(s.name, s.arguments, s.result) for s in spans] == [
        ("get_weather", '{"city": "Paris"}', "18C"),
        ("get_weather", '{"city": "Oslo"}', "Error when executing tool: timeout"),
    ]
    assert all(s.observed == "parsed_from_text" and s.requested_by == 0 for s in spans)
    assert [(s.start, s.end) for s in spans] == [(1.0, 3.0), (1.0, 3.0)]
    assert spans[1].error is not None and spans[1].error.type == "tool_error"
    assert first.outputs[0].response_text == said
    # The second prompt re-renders the first response, so the pieces do not spell out the
    # transcript: it is stored whole.
    assert trajectory.transcript == qwen_tokenizer.decode(
        [*(second.prompt.token_ids or []), *(second.outputs[0].token_ids or [])]
    )
