"""An asynchronous RL run in miniature, as verl's partial rollout makes one through a proxy:
calls tell their policy version in `X-Rollout-Weight-Version` (vLLM's `/v1/completions`
reports none, so the verl plugin sends it) and their sample id in `X-Rollout-Sample-Id`.

Sample 0 starts on version 3; a weight sync pauses the server with `mode=abort` while it
streams, the version becomes 4, and the rollout is re-sent with the tokens it had (one call,
two attempts). Sample 1 runs on version 4 alone. Then the version becomes 5 and the proxy
stops: both rollouts close one version behind (sample 0 spans 3 to 4, sample 1 does not)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from trace_proxy.demo.simulated_vllm import SimulatedVLLM

EXPERIMENT = "async"
MODEL = "tiny-qwen"
CHATML = "<|im_start|>user\nCount slowly.<|im_end|>\n<|im_start|>assistant\n"


def headers(sample: int, version: str) -> dict[str, str]:
    return {"X-Rollout-Experiment": EXPERIMENT, "X-Rollout-Step": "1",
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0",
            "X-Rollout-Sample-Id": f"uid-{sample}",
            "X-Rollout-Weight-Version": version}  # fmt: skip


def sse_ids(data: bytes) -> list[int]:
    """The token ids of a `/v1/completions` stream, in order."""
    ids: list[int] = []
    for line in data.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                ids += choice.get("token_ids") or []
    return ids


async def control(session: aiohttp.ClientSession, url: str, body: Any = None) -> None:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()


async def partial_rollouts(session: aiohttp.ClientSession, proxy: str, tokenizer: Any) -> list[int]:
    """Runs the two samples; returns the tokens sample 0 generated on version 3."""
    prompt = tokenizer.encode(CHATML)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    async with session.post(proxy + "/v1/completions", json=body, headers=headers(0, "3")) as r:
        head = await r.content.readuntil(b"\n\n")  # generating: the sync comes now
        await control(session, proxy + "/pause?mode=abort")
        carried = sse_ids(head + await r.read())
    await control(session, proxy + "/update_weight_version", {"new_version": "4"})
    await control(session, proxy + "/resume")
    resumed = {"model": MODEL, "prompt": prompt + carried, "max_tokens": 3,
               "return_token_ids": True}  # fmt: skip
    async with session.post(proxy + "/v1/completions", json=resumed,
                            headers=headers(0, "4")) as r:  # fmt: skip
        assert (await r.json())["choices"][0]["token_ids"]
    whole = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "return_token_ids": True}
    async with session.post(proxy + "/v1/completions", json=whole, headers=headers(1, "4")) as r:
        assert r.status == 200
    await control(session, proxy + "/update_weight_version", {"new_version": "5"})
    return carried


@contextlib.asynccontextmanager
async def upstream(tokenizer: Any) -> AsyncIterator[str]:
    """The simulated vLLM, slow enough (a token per 5 ms) for a sync to land mid-stream."""
    async with SimulatedVLLM(tokenizer, model=MODEL, token_delay=0.005).serve() as url:
        yield url


# What each sample's record says of its versions: (min, max, latest, partial, sample id).
EXPECTED = {0: ("3", "4", "5", True, "uid-0"), 1: ("4", "4", "5", False, "uid-1")}


def by_sample(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The workload's trajectory records (as the store holds them), by sample, checked."""
    found = {
        r["key"]["sample_index"]: r
        for r in records
        if r.get("record") == "trajectory" and r["key"]["experiment"] == EXPERIMENT
    }
    assert sorted(found) == [0, 1]
    for sample, record in found.items():
        assert (
            record["weight_version_min"], record["weight_version_max"],
            record["weight_version_latest"], record["partial_rollout"], record["key"]["sample_id"],
        ) == EXPECTED[sample]  # fmt: skip
    [resumed] = found[0]["calls"]
    assert [s["weight_version"] for s in resumed["segments"]] == ["3", "4"]
    return found
