"""Real drifting traffic: the real `openai` client on /v1/completions keeps each reply as text
and sends it back in the next prompt (the server tokenizes it again), while the simulated vLLM
(`split_words`) generates ids that the real Qwen tokenizer does not give back for that text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
from fakes import FakeVLLM

from support.proxies import running_proxy
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer

FIRST = "<|im_start|>user\nTell me about the gradient.<|im_end|>\n<|im_start|>assistant\n"
MORE = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
TURNS = 3


@dataclass
class TextClientRun:
    replies: list[Any]  # each turn's first choice, as the openai client returned it
    metrics: str  # the proxy's /metrics once every record was exported
    prompts: list[list[int]]  # each turn's prompt as the server tokenizes it (its /tokenize)


async def text_client_rollout(
    qwen_tokenizer: Any, output: Path, ids_in_logprobs: bool = False
) -> TextClientRun:
    """One trajectory of TURNS calls through a proxy with token2text, recorded in `output`.
    The replies carry their token ids (`return_token_ids`, with the prompt's ids), or with
    `ids_in_logprobs` only as logprob tokens (`return_tokens_as_token_ids`, AReaL's payload),
    so the prompt's ids are not in the response."""
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True, split_words=True)
    settings = {"token2text": True, "tokenizer": [str(ensure_qwen_tokenizer())]}
    async with (
        fake.serve() as upstream,
        running_proxy([upstream], output, **settings) as (service, proxy),
    ):
        client = openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)
        prompt, replies, prompts = FIRST, [], []
        if ids_in_logprobs:
            extra: dict[str, Any] = {"return_tokens_as_token_ids": True, "logprobs": 1}
        else:
            extra = {"return_token_ids": True}
        for turn in range(TURNS):
            headers = {"X-Rollout-Trajectory-Id": "text-client"}
            if turn == TURNS - 1:
                headers["X-Rollout-Done"] = "true"
            reply = await client.completions.create(
                model="tiny-qwen", prompt=prompt, max_tokens=40, extra_body=extra,
                extra_headers=headers,
            )  # fmt: skip
            replies.append(reply.choices[0])
            prompts.append(await tokenized(upstream, prompt))
            prompt = prompt + reply.choices[0].text + MORE  # the reply kept as text
        await client.close()
        await service.flush()
        metrics = await metrics_text(service)
    return TextClientRun(replies, metrics, prompts)


async def tokenized(upstream: str, prompt: str) -> list[int]:
    """The server's own tokenization of a text prompt (vLLM's /tokenize)."""
    body = {"model": "tiny-qwen", "prompt": prompt}
    async with aiohttp.ClientSession() as session:
        async with session.post(upstream + "/tokenize", json=body) as response:
            tokens: list[int] = (await response.json())["tokens"]
            return tokens


async def metrics_text(service: Any) -> str:
    admin = service.addresses.admin
    async with aiohttp.ClientSession() as session, session.get(admin + "/metrics") as response:
        return await response.text()


def drift_count(metrics: str, kind: str) -> float:
    """`trace_proxy_retokenization_drift_calls_total{kind=...}` as /metrics shows it."""
    line = f'trace_proxy_retokenization_drift_calls_total{{kind="{kind}"}} '
    [value] = [row[len(line) :] for row in metrics.splitlines() if row.startswith(line)]
    return float(value)
