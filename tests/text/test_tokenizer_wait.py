"""No ambiguity while the tokenizer loads: text-only replies continued by token-id prompts (what
skyrl-train sends vLLM) are told apart by decoding, and calls that need the tokenizer wait for
it, bounded and counted, instead of being recorded as `inferred:ambiguous`.

The tokenizer is the real Qwen one; its loading is held back by the test (an event), so that
the traffic surely arrives while it loads, then let go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support.proxies import (
    HeldLoader,
    metric,
    release_as_stop_begins,
    running_proxy,
    scripted_upstream,
    trajectories,
)

from trace_proxy.capture import stage as stage_module
from trace_proxy.config import Settings
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.processes import text_path
from trace_proxy.proxy.service import ProxyService
from trace_proxy.text.token2text import TokenizerError
from trace_proxy.trajectories.prompts import expand_prompts

GUARD = 60.0  # seconds: a failure bound, not a synchronisation
FIRST = "Question: what is the capital of France? Answer briefly."
REPLIES = ["Paris is the capital.", "I believe it is Lyon."]


class TextOnlyVLLM:
    """vLLM's /v1/completions without `return_token_ids`: the reply comes as text only (the
    response shape of inference-apis.md, trimmed to what the dialect reads). The group's first
    calls get REPLIES in turn; every later call a short answer."""

    def __init__(self) -> None:
        self.calls = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = REPLIES[self.calls] if self.calls < len(REPLIES) else " Done."
        self.calls += 1
        return web.json_response({
            "id": f"cmpl-{self.calls}", "object": "text_completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": "stop", "stop_reason": None}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 5,
                      "total_tokens": len(body["prompt"]) + 5},
        })  # fmt: skip


async def roll_out(proxy: str, tokenizer: Any) -> None:
    """Two rollouts of one prompt (a GRPO group), then each continued with its own reply
    re-tokenized and a tool's output, in the opposite order: only decoding tells them apart."""
    first = tokenizer.encode(FIRST)
    async with aiohttp.ClientSession() as session:
        for _ in REPLIES:
            body = {"model": "tiny-qwen", "prompt": first, "max_tokens": 8}
            async with session.post(proxy + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        for reply in reversed(REPLIES):
            more = tokenizer.encode(reply + "\n<tool_response>42</tool_response>\n")
            body = {"model": "tiny-qwen", "prompt": first + more, "max_tokens": 8}
            async with session.post(proxy + "/v1/completions", json=body) as resp:
                assert resp.status == 200


async def until(condition: Any) -> None:
    """Poll a condition of the proxy's own (a continuation waiting for the tokenizer), within
    GUARD: the capture stage parses on its own schedule, after the requests were answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not condition():
        assert loop.time() < deadline, "the condition never came true"
        await asyncio.sleep(0.01)


def ambiguous(recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in recorded if t["key"]["sources"]["trajectory_id"] == "inferred:ambiguous"]


async def serve(settings: Settings) -> tuple[ProxyService, str]:
    service = ProxyService(settings)
    addresses = await service.start()
    return service, addresses.proxy


@pytest.mark.parametrize("token2text", [False, True])
async def test_continuations_wait_for_the_loading_tokenizer(
    tmp_path: Path, qwen_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, token2text: bool
) -> None:
    loader = HeldLoader()
    monkeypatch.setattr(text_path, "load_configured", loader)
    upstream = TextOnlyVLLM()
    async with scripted_upstream(upstream.handle) as up:
        settings = dataclasses.replace(
            Settings(), upstream=[up], port=0, admin_port=0, output=tmp_path,
            capture_mode="inline", export_mode="inline", token2text=token2text,
            tokenizer=[str(ensure_qwen_tokenizer())],
        )  # fmt: skip
        service, proxy = await serve(settings)
        try:
            assert service.readiness()["tokenizer"] == "loading"  # /ready is 503 meanwhile
            await roll_out(proxy, qwen_tokenizer)
            assert service.readiness()["tokenizer"] == "loading"
            await until(lambda: service.inline.capture.waiting_for_decoders)
            loader.released.set()
            await asyncio.wait_for(service.wait_ready(), GUARD)
            assert service.readiness()["tokenizer"] == "ok"
            await asyncio.wait_for(service.flush(), GUARD)
            waited = metric(service.metrics, "trace_proxy_inference_decoder_waits_total",
                            outcome="decoded")  # fmt: skip
        finally:
            loader.released.set()
            await service.stop()
    recorded = trajectories(tmp_path)
    assert waited >= 1
    assert not ambiguous(recorded)
    assert len(recorded) == 2
    first = qwen_tokenizer.encode(FIRST)
    for t in recorded:
        assert len(t["calls"]) == 2
        [reply] = [o["text"] for o in t["calls"][0]["outputs"]]
        prompts = expand_prompts(t)
        assert prompts[0]["token_ids"] == first
        # the second prompt carries this very rollout's reply after the first prompt
        assert qwen_tokenizer.decode(prompts[1]["token_ids"][len(first) :]).startswith(reply)


async def test_the_wait_is_bounded_and_what_stays_undecided_is_marked(
    tmp_path: Path, qwen_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that does not come in time: the calls that waited are placed as ambiguous
    (never attached to a guess), and counted."""
    loader = HeldLoader()
    monkeypatch.setattr(text_path, "load_configured", loader)
    monkeypatch.setattr(stage_module, "DECODER_WAIT", 0.5)
    upstream = TextOnlyVLLM()
    async with scripted_upstream(upstream.handle) as up:
        settings = dataclasses.replace(
            Settings(), upstream=[up], port=0, admin_port=0, output=tmp_path,
            capture_mode="inline", export_mode="inline",
            tokenizer=[str(ensure_qwen_tokenizer())],
        )  # fmt: skip
        service, proxy = await serve(settings)
        try:
            await roll_out(proxy, qwen_tokenizer)
            await asyncio.wait_for(service.recorder.capture.drain(), GUARD)
            undecided = metric(service.metrics, "trace_proxy_inference_decoder_waits_total",
                               outcome="no_decoder")  # fmt: skip
        finally:
            loader.released.set()
            await service.stop()
    assert undecided == 1  # the first continuation waited; later ones did not wait again
    recorded = trajectories(tmp_path)
    ambiguous = [
        t for t in recorded if t["key"]["sources"]["trajectory_id"] == "inferred:ambiguous"
    ]
    assert len(ambiguous) == 2
    assert all(len(t["calls"]) == 1 for t in recorded)


async def test_ready_names_the_tokenizer_without_token2text(
    tmp_path: Path, qwen_tokenizer: Any
) -> None:
    """The capture process (the default) loads --tokenizer for inference; /ready waits for it
    and says so, and text-only continuations are then told apart."""
    upstream = TextOnlyVLLM()
    async with (
        scripted_upstream(upstream.handle) as up,
        running_proxy([up], tmp_path, tokenizer=[str(ensure_qwen_tokenizer())]) as (service, proxy),
    ):
        assert service.readiness()["tokenizer"] == "ok"
        await roll_out(proxy, qwen_tokenizer)
    recorded = trajectories(tmp_path)
    assert sorted(len(t["calls"]) for t in recorded) == [2, 2]
    assert not ambiguous(recorded)


async def test_a_tokenizer_that_does_not_load_stops_the_proxy(tmp_path: Path) -> None:
    """Without token2text too: --tokenizer names a directory that holds no tokenizer."""
    empty = tmp_path / "not-a-tokenizer"
    empty.mkdir()
    async with scripted_upstream(TextOnlyVLLM().handle) as up:
        with pytest.raises(TokenizerError):
            async with running_proxy([up], tmp_path / "out", tokenizer=[str(empty)]):
                pass


# skyrl-train 0.3.1's RemoteInferenceEngine with a vLLM server: a GRPO group of four sampled
# rollouts of one prompt, two turns, one batched /v1/completions request per turn.
GROUP_REPLIES = [" Paris.", " Lyon, I think.", " It is Paris!", " Marseille"]
ENVIRONMENT = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"


class BatchedTextVLLM:
    """vLLM's /v1/completions for a batch (`prompt` a list of token-id lists) without
    `return_token_ids`: choice `index` is the prompt's (n = 1), its reply text only; every
    field vLLM dumps, nulls included (inference-apis.md). The first batch gets the group's
    replies, every later one a short answer per prompt."""

    def __init__(self) -> None:
        self.batches = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompts = body["prompt"]
        texts = GROUP_REPLIES if self.batches == 0 else [" Done."] * len(prompts)
        self.batches += 1
        prompt_tokens = sum(len(p) for p in prompts)
        return web.json_response({
            "id": f"cmpl-{self.batches}", "object": "text_completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": "stop",
                         "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "routed_experts": None,
                         "weight_versions": None} for i, text in enumerate(texts)],
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 8,
                      "completion_tokens": 8, "prompt_tokens_details": None,
                      "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        })  # fmt: skip


async def skyrl_train_generate(proxy: str, prompts: list[list[int]]) -> list[str]:
    """One batch as skyrl-train 0.3.1's `RemoteInferenceEngine.generate` sends it to vLLM
    (a copy of the sampling params, then `model` and `prompt`, posted with aiohttp's `json=`
    in a session of its own); the replies as it keeps them: text."""
    payload: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8}
    payload["model"] = "tiny-qwen"
    payload["prompt"] = prompts
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session,
        session.post(
            proxy + "/v1/completions", json=payload, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        assert resp.status == 200
        response = await resp.json()
    return [choice["text"] for choice in response["choices"]]


async def skyrl_train_group(proxy: str, tokenizer: Any) -> list[list[int]]:
    """The group's two turns; turn 2's prompts are turn 1's, each reply re-encoded (what
    skyrl-train does with text replies) and an environment turn. Turn 1's prompts."""
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [tokenizer.encode(first, add_special_tokens=False)] * len(GROUP_REPLIES)
    replies = await skyrl_train_generate(proxy, prompts)
    environment = tokenizer.encode(ENVIRONMENT, add_special_tokens=False)
    second = [
        [*p, *tokenizer.encode(r, add_special_tokens=False), *environment]
        for p, r in zip(prompts, replies, strict=True)
    ]
    await skyrl_train_generate(proxy, second)
    return prompts


@pytest.mark.parametrize(
    ("token2text", "export_mode"), [(False, "inline"), (True, "process")]
)  # fmt: skip
async def test_a_batched_group_sent_while_the_tokenizer_loads_is_told_apart_at_stop(
    tmp_path: Path,
    qwen_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
    token2text: bool,
    export_mode: str,
) -> None:
    loader = HeldLoader()
    monkeypatch.setattr(text_path, "load_configured", loader)
    async with scripted_upstream(BatchedTextVLLM().handle) as up:
        settings = dataclasses.replace(
            Settings(), upstream=[up], port=0, admin_port=0, output=tmp_path,
            capture_mode="inline", export_mode=export_mode, token2text=token2text,
            tokenizer=[str(ensure_qwen_tokenizer())],
        )  # fmt: skip
        service, proxy = await serve(settings)
        release_as_stop_begins(service, loader)
        try:
            first_prompts = await skyrl_train_group(proxy, qwen_tokenizer)
            await until(lambda: service.inline.capture.waiting_for_decoders)
        finally:
            await service.stop()
            loader.released.set()
    waited = metric(service.metrics, "trace_proxy_inference_decoder_waits_total",
                    outcome="decoded")  # fmt: skip
    recorded = trajectories(tmp_path)
    assert not ambiguous(recorded)
    assert sorted(len(t["calls"]) for t in recorded) == [2, 2, 2, 2]
    assert waited == 1
    environment = qwen_tokenizer.encode(ENVIRONMENT, add_special_tokens=False)
    replies = []
    for t in recorded:
        [reply] = [o["text"] for o in t["calls"][0]["outputs"]]
        replies.append(reply)
        first, second = (p["token_ids"] for p in expand_prompts(t))
        assert first == first_prompts[0]
        # the second prompt carries this very rollout's reply, as the client re-encoded it
        assert second == [*first, *qwen_tokenizer.encode(reply, add_special_tokens=False),
                          *environment]  # fmt: skip
    assert sorted(replies) == sorted(GROUP_REPLIES)
    assert len({t["key"]["sample_hash"] for t in recorded}) == 1
    assert sorted(t["key"]["rollout_n"] for t in recorded) == [0, 1, 2, 3]


@pytest.mark.parametrize(("bounded", "grace"), [(False, 4.0), (True, 12.0)])
async def test_a_stop_waits_for_the_loading_tokenizer_within_its_grace(
    tmp_path: Path,
    qwen_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
    bounded: bool,
    grace: float,
) -> None:
    """The tokenizer never loads: at a stop, the call that waits for it waits up to
    --shutdown-grace (a quarter of it when the stop must end in time, `bounded`: a capture
    process whose proxy is gone, which has half the grace to parse), then is placed as
    ambiguous, and the calls queued behind it are parsed, not counted dropped."""
    loader = HeldLoader()
    monkeypatch.setattr(text_path, "load_configured", loader)
    async with scripted_upstream(BatchedTextVLLM().handle) as up:
        settings = dataclasses.replace(
            Settings(), upstream=[up], port=0, admin_port=0, output=tmp_path,
            capture_mode="inline", export_mode="inline", shutdown_grace=grace,
            tokenizer=[str(ensure_qwen_tokenizer())],
        )  # fmt: skip
        service, proxy = await serve(settings)
        stop = service.recorder.stop
        service.recorder.stop = functools.partial(stop, bounded=bounded)  # type: ignore[method-assign]
        try:
            await skyrl_train_group(proxy, qwen_tokenizer)
            await until(lambda: service.inline.capture.waiting_for_decoders)
            other = qwen_tokenizer.encode("Name a prime number.")
            await skyrl_train_generate(proxy, [other])  # queued behind the waiting batch
        finally:
            await asyncio.wait_for(service.stop(), GUARD)  # not DECODER_WAIT after the start
            loader.released.set()
    dropped = metric(service.metrics, "trace_proxy_capture_dropped_total", reason="shutdown")
    undecided = metric(service.metrics, "trace_proxy_inference_decoder_waits_total",
                       outcome="no_decoder")  # fmt: skip
    recorded = trajectories(tmp_path)
    assert dropped == 0 and undecided == 1
    assert len(ambiguous(recorded)) == 4
    assert sorted(len(t["calls"]) for t in recorded) == [1] * 9
    assert [other] in [[p["token_ids"] for p in expand_prompts(t)] for t in recorded]
