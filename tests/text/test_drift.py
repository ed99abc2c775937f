"""Retokenization drift: found with the real Qwen tokenizer, on real clients' traffic, marked
in the record and counted on /metrics; correct traffic is never marked."""

from __future__ import annotations

import asyncio
import html
import io
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from fakes import FakeVLLM
from support.drift_traffic import (
    FIRST,
    MORE,
    TURNS,
    TextClientRun,
    drift_count,
    metrics_text,
    text_client_rollout,
)
from support.proxies import running_proxy, trajectories

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.show import show
from trace_proxy.text.drift import Codec, codec_for, prefix_drift, roundtrip_drift
from trace_proxy.text.token2text import Token2Text, load_configured
from trace_proxy.text.toolparsers import get_parser
from trace_proxy.trajectories.record import GenerateCall, Output, Prompt, RolloutKey, Trajectory
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import Viewer

IM_END = 151645


@pytest.fixture(scope="module")
def codec(qwen_tokenizer: Any) -> Codec:
    return codec_for(qwen_tokenizer)


def split_word(codec: Codec, qwen_tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids with its first word of six letters or more as two vocabulary pieces: the
    same text, ids that the tokenizer does not give back (checked here, not assumed)."""
    ids = codec.encode(text)
    backend = qwen_tokenizer.backend_tokenizer
    for position, token in enumerate(ids):
        name = backend.id_to_token(token)
        for cut in range(2, len(name) - 1):
            first, second = backend.token_to_id(name[:cut]), backend.token_to_id(name[cut:])
            if len(name) >= 6 and first is not None and second is not None:
                split = [*ids[:position], first, second, *ids[position + 1 :]]
                assert codec.decode(split) == text and codec.encode(text) != split
                return split
    raise AssertionError(f"no word of {text!r} splits")


def test_a_split_word_does_not_round_trip_and_canonical_ids_do(
    codec: Codec, qwen_tokenizer: Any
) -> None:
    text = " The gradient looks consistent with the earlier steps."
    canonical = [*codec.encode(text), IM_END]
    assert roundtrip_drift(codec, canonical) is None
    split = [*split_word(codec, qwen_tokenizer, text), IM_END]
    at = next(i for i, (a, b) in enumerate(zip(split, canonical, strict=False)) if a != b)
    assert roundtrip_drift(codec, split) == {
        "at": at,
        "expected": split[at],
        "got": canonical[at],
        "expected_text": codec.decode([split[at]]),
        "got_text": codec.decode([canonical[at]]),
    }


def test_the_next_prompt_is_judged_only_where_it_continues_the_call(
    codec: Codec, qwen_tokenizer: Any
) -> None:
    prompt = codec.encode(FIRST)
    text = " The gradient looks consistent."
    response = [*split_word(codec, qwen_tokenizer, text), IM_END]
    more = codec.encode(MORE)
    # Token in, token out: the ids come back as generated, with or without the stop token.
    assert prefix_drift(codec, prompt, response, [*prompt, *response, *more[1:]]) is None
    without_stop = [*prompt, *response[:-1], *codec.encode("\nUser: and then?")]
    assert prefix_drift(codec, prompt, response, without_stop) is None
    # Not a continuation: a retry of the same prompt, another conversation.
    assert prefix_drift(codec, prompt, response, prompt) is None
    assert prefix_drift(codec, prompt, response, codec.encode("Another question.")) is None
    # The reply kept as text and tokenized again.
    again = codec.encode(FIRST + text + MORE)
    drift = prefix_drift(codec, prompt, response, again)
    assert drift is not None and drift["in"] == "response"
    at = drift["at"]
    assert prompt == again[: len(prompt)] and at >= len(prompt)
    assert [*prompt, *response][:at] == again[:at]
    assert (drift["expected"], drift["got"]) == (response[at - len(prompt)], again[at])
    rest = codec.decode(response[at - len(prompt) + 1 :])
    assert (drift["expected_text"] + rest).startswith(drift["got_text"])  # the same text


def test_a_template_that_rewrites_the_reply_is_drift(codec: Codec) -> None:
    prompt = codec.encode(FIRST)
    response = [*codec.encode("<think>\nHmm.\n</think>\n\nIt descends."), IM_END]
    rendered = codec.encode(FIRST + "It descends." + MORE)  # the thinking dropped
    drift = prefix_drift(codec, prompt, response, rendered)
    assert drift is not None
    assert (drift["at"], drift["expected_text"], drift["in"]) == (
        len(prompt),
        "<think>",
        "response",
    )


@pytest.fixture(scope="module")
def text_client(
    qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TextClientRun, Path]:
    output = tmp_path_factory.mktemp("drift-store")
    return asyncio.run(text_client_rollout(qwen_tokenizer, output)), output


def test_a_text_client_re_tokenizing_replies_is_marked_and_counted(
    codec: Codec, text_client: tuple[TextClientRun, Path]
) -> None:
    """The real openai client on /v1/completions keeps each reply as text and sends it back
    in the next prompt; the model's ids split words, so the server's tokenization differs."""
    run, output = text_client
    replies = run.replies
    [trajectory] = trajectories(output)
    calls = trajectory["calls"]
    assert [c["drift"] is not None for c in calls] == [True] * TURNS
    for position, call in enumerate(calls):
        generated = call["outputs"][0]["token_ids"]
        assert generated == replies[position].model_extra["token_ids"]
        assert codec.encode(codec.decode(generated)) != generated  # really does not round-trip
        assert call["drift"]["roundtrip"]["output"] == 0
    # Each next prompt, tokenized by the server from text, leaves the generated ids.
    first_prompt = replies[0].model_extra["prompt_token_ids"]
    second_prompt = replies[1].model_extra["prompt_token_ids"]
    expected = [*first_prompt, *calls[0]["outputs"][0]["token_ids"]]
    prefix = calls[0]["drift"]["prefix"]
    at = prefix["at"]
    assert len(first_prompt) <= at < len(expected) and prefix["in"] == "response"
    assert expected[:at] == second_prompt[:at]
    assert (prefix["expected"], prefix["got"]) == (expected[at], second_prompt[at])
    assert prefix["expected_text"] == codec.decode([expected[at]])
    assert prefix["got_text"] == codec.decode([second_prompt[at]])
    assert "prefix" in calls[1]["drift"] and "prefix" not in calls[2]["drift"]  # last: no next
    assert trajectory["summary"]["drift_calls"] == TURNS
    assert drift_count(run.metrics, "prefix") == TURNS - 1
    assert drift_count(run.metrics, "roundtrip") == TURNS


def test_show_prints_the_drift_marks(text_client: tuple[TextClientRun, Path]) -> None:
    _, output = text_client
    [trajectory] = trajectories(output)
    out = io.StringIO()
    assert show(output, out=out) == 0
    shown = out.getvalue()
    assert f"{TURNS} calls with retokenization drift" in shown
    prefix = trajectory["calls"][0]["drift"]["prefix"]
    first = token_shown(prefix["expected"], prefix["expected_text"])
    assert f"~ prefix drift at {prefix['at']}: {first} -> " in shown


def test_without_prompt_ids_the_text_prompt_is_encoded_as_the_server_does(
    qwen_tokenizer: Any, codec: Codec, tmp_path: Path
) -> None:
    """AReaL's payload: the reply's ids only as logprob tokens, the prompt's not at all; the
    prompt's text encoded as vLLM's /tokenize does finds the same drift."""
    run = asyncio.run(text_client_rollout(qwen_tokenizer, tmp_path, ids_in_logprobs=True))
    [trajectory] = trajectories(tmp_path)
    calls = trajectory["calls"]
    assert all(c["prompt"]["token_ids"] is None for c in calls)
    assert ["prefix" in (c["drift"] or {}) for c in calls] == [True] * (TURNS - 1) + [False]
    for position in range(TURNS - 1):
        generated = calls[position]["outputs"][0]["token_ids"]
        expected = [*run.prompts[position], *generated]
        following = run.prompts[position + 1]
        prefix = calls[position]["drift"]["prefix"]
        at = prefix["at"]
        assert expected[:at] == following[:at] and expected[at] != following[at]
        assert (prefix["expected"], prefix["got"]) == (expected[at], following[at])
    assert drift_count(run.metrics, "prefix") == TURNS - 1


def token_shown(token: int, text: str) -> str:
    """A token as the drift mark shows it: its id and its text as a JSON string."""
    return f"{token} {json.dumps(text)}"


async def test_the_viewer_lists_the_drifting_calls_and_marks_them(
    text_client: tuple[TextClientRun, Path],
) -> None:
    _, output = text_client
    [trajectory] = trajectories(output)
    async with TestClient(TestServer(Viewer(StoreIndex([output], min_interval=0)).app())) as client:
        found = re.search(r'href="(/run/0/[^"]+)/"', await (await client.get("/")).text())
        assert found is not None
        run_url = html.unescape(found.group(1))
        run_page = await (await client.get(run_url + "/")).text()
        assert "1 trajectory with drifting calls" in run_page
        assert f'href="{run_url}/drift"' in run_page
        step_page = await (await client.get(run_url + "/step/none")).text()
        assert f'<span class="bad drift-badge">{TURNS} drifting</span>' in step_page
        listing = html.unescape(await (await client.get(run_url + "/drift")).text())
        assert f"{TURNS} drifting calls in 1 trajectories" in listing
        assert listing.count('class="drift-row"') == TURNS
        prefix = trajectory["calls"][0]["drift"]["prefix"]
        assert token_shown(prefix["expected"], prefix["expected_text"]) in listing
        assert token_shown(prefix["got"], prefix["got_text"]) in listing
        assert f"/t/{trajectory['id']}#turn-0" in listing
        page = html.unescape(await (await client.get(run_url + f"/t/{trajectory['id']}")).text())
        assert page.count('class="turn drifting"') == TURNS
        assert f"{TURNS} drifting calls" in page
        first_turn = page[page.index('id="turn-0"') : page.index('id="turn-1"')]
        assert "prefix drift" in first_turn and "roundtrip drift" in first_turn
        assert f"at its token {prefix['at']}" in first_turn
        assert token_shown(prefix["expected"], prefix["expected_text"]) in first_turn


async def test_a_token_in_multi_turn_trajectory_is_not_marked(
    qwen_tokenizer: Any, codec: Codec, fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    """A client that sends back the generated ids (and the stop token) drifts nowhere."""
    _, upstream = fake_vllm
    settings = {"token2text": True, "tokenizer": [str(ensure_qwen_tokenizer())]}
    async with running_proxy([upstream], tmp_path, **settings) as (service, proxy):
        ids = codec.encode(FIRST)
        async with aiohttp.ClientSession() as session:
            for turn in range(3):
                headers = {"X-Rollout-Trajectory-Id": "token-client"}
                if turn == 2:
                    headers["X-Rollout-Done"] = "true"
                body = {"model": "tiny-qwen", "token_ids": ids,
                        "sampling_params": {"max_tokens": 40}}  # fmt: skip
                async with session.post(
                    proxy + "/inference/v1/generate", json=body, headers=headers
                ) as response:
                    assert response.status == 200
                    answer = await response.json()
                ids = [*ids, *answer["choices"][0]["token_ids"], *codec.encode(MORE)[1:]]
        await service.flush()
        metrics = await metrics_text(service)
    [trajectory] = trajectories(tmp_path)
    assert len(trajectory["calls"]) == 3
    assert [c["drift"] for c in trajectory["calls"]] == [None, None, None]
    assert trajectory["summary"]["drift_calls"] == 0
    assert drift_count(metrics, "prefix") == drift_count(metrics, "roundtrip") == 0


def drifting_trajectory(codec: Codec, qwen_tokenizer: Any) -> Trajectory:
    """Two calls: the first's reply split into non-canonical ids, sent back as text."""
    prompt = codec.encode(FIRST)
    text = " The gradient looks consistent."
    response = [*split_word(codec, qwen_tokenizer, text), IM_END]
    calls = [
        GenerateCall(
            index=i,
            dialect="vllm.generate",
            route="/inference/v1/generate",
            upstream="u",
            start=float(i),
            end=i + 0.5,
            model="tiny-qwen",
            prompt=Prompt(token_ids=ids),
            outputs=[Output(index=0, token_ids=out, finish_reason="stop")],
        )
        for i, (ids, out) in enumerate(
            [(prompt, response), (codec.encode(FIRST + text + MORE), [IM_END])]
        )
    ]
    key = RolloutKey(project="p", experiment="e")
    return Trajectory(id="t", key=key, start=0.0, end=2.0, status="ok",
                      close_reason="done", calls=calls)  # fmt: skip


def test_drift_checks_can_be_turned_off(qwen_tokenizer: Any, codec: Codec) -> None:
    tokenizers = load_configured([str(ensure_qwen_tokenizer())], skip_special_tokens=False)
    counted: list[str] = []
    checked = drifting_trajectory(codec, qwen_tokenizer)
    Token2Text(tokenizers, get_parser("hermes"), on_drift=counted.append).process([checked])
    assert [c.drift is not None for c in checked.calls] == [True, False]
    assert counted == ["prefix", "roundtrip"] and checked.summary["drift_calls"] == 1
    unchecked = drifting_trajectory(codec, qwen_tokenizer)
    Token2Text(tokenizers, get_parser("hermes"), check_drift=False).process([unchecked])
    assert [c.drift for c in unchecked.calls] == [None, None]
    assert "drift_calls" not in unchecked.summary
    assert unchecked.calls[0].outputs[0].response_text is not None  # still decoded
