"""token2text: decoded text next to the ids, tokenizers loaded once, errors at start-up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from fakes import FakeVLLM, StartFake
from support.proxies import running_proxy, trajectories

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.trajectories.prompts import transcript_of

CHATML = "<|im_start|>user\nSay something nice.<|im_end|>\n<|im_start|>assistant\n"


async def send(proxy: str, session: aiohttp.ClientSession, prompt_ids: list[int]) -> Any:
    body = {"model": "tiny-qwen", "prompt": prompt_ids, "max_tokens": 24, "return_token_ids": True}
    async with session.post(proxy + "/v1/completions", json=body) as response:
        return await response.json()


async def test_prompt_and_response_text_with_special_tokens_kept(
    qwen_tokenizer: Any, fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    prompt_ids = qwen_tokenizer.encode(CHATML)
    settings = {"token2text": True, "tokenizer": [str(ensure_qwen_tokenizer())]}
    async with running_proxy([upstream], tmp_path, **settings) as (_, proxy):
        async with aiohttp.ClientSession(headers={"X-Rollout-Trajectory-Id": "t"}) as session:
            reply = await send(proxy, session, prompt_ids)
    [trajectory] = trajectories(tmp_path)
    [call] = trajectory["calls"]
    [choice] = reply["choices"]
    assert call["prompt_text"] == CHATML
    output = call["outputs"][0]
    assert output["response_text"] == qwen_tokenizer.decode(choice["token_ids"])
    # vLLM's own text skips special tokens; ours keeps them (as verl does), so it extends it.
    assert output["response_text"].startswith(choice["text"])
    # Not stored twice: one call's pieces already spell the transcript out.
    assert trajectory["transcript"] is None
    assert transcript_of(trajectory) == CHATML + output["response_text"]


async def test_skip_special_tokens_matches_the_servers_text(
    qwen_tokenizer: Any, fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    settings = {
        "token2text": True,
        "skip_special_tokens": True,
        "tokenizer": [f"tiny-qwen={ensure_qwen_tokenizer()}"],
    }
    async with running_proxy([upstream], tmp_path, **settings) as (_, proxy):
        async with aiohttp.ClientSession(headers={"X-Rollout-Trajectory-Id": "t"}) as session:
            reply = await send(proxy, session, qwen_tokenizer.encode(CHATML))
    [call] = trajectories(tmp_path)[0]["calls"]
    assert call["outputs"][0]["response_text"] == reply["choices"][0]["text"]
    assert "<|im_start|>" not in call["prompt_text"]


async def test_tokenizer_discovered_from_the_upstream(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    model_dir = str(ensure_qwen_tokenizer())  # the upstream reports this as its model path
    upstream = await start_fake(FakeVLLM(qwen_tokenizer, model=model_dir, deterministic=True))
    async with running_proxy([upstream], tmp_path, token2text=True) as (service, proxy):
        assert service.tokenizer_discovery is not None
        await asyncio.wait_for(service.tokenizer_discovery, 60)
        async with aiohttp.ClientSession(headers={"X-Rollout-Trajectory-Id": "t"}) as session:
            body = {"model": model_dir, "prompt": qwen_tokenizer.encode(CHATML), "max_tokens": 8}
            async with session.post(proxy + "/v1/completions", json=body) as response:
                assert response.status == 200
    [call] = trajectories(tmp_path)[0]["calls"]
    assert call["prompt_text"] == CHATML


def test_a_tokenizer_that_cannot_load_fails_at_start_up(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trace_proxy", "serve", "--upstream", "http://127.0.0.1:9",
         "--port", "0", "--admin-port", "0", "--token2text",
         "--tokenizer", str(tmp_path / "no-such-tokenizer")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokenizer" in lines[0] and "no-such-tokenizer" in lines[0]
