"""A fixed RL workload, sent one call at a time, so that what the proxy records is the same
on every run: the golden test's input.

Two proxies, as each inference server gets its own sidecar: one before the simulated vLLM, one
before the fake SGLang. Through them go every dialect, plain and streamed; chat turns with tool
calls and their results; token-in multi-turn rollouts; a batched text completion; rollouts with
no metadata at all (placed by inference); two training steps with a weight update between them;
a validation step; top-N sampling (2 samples of 3 kept per step); rewards sent with the last
turn, sent after the trajectory was written (a late reward), and sent for a sample the sampler
dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from fakes import FakeSGLang, FakeVLLM
from support.proxies import running_proxy

EXPERIMENT = "golden"
MODEL = "tiny-qwen"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]  # fmt: skip
QUESTIONS = ["What is the weather in Paris?", "What is 17 * 23 + 4?", "Is it raining in Oslo?"]
SETTINGS: dict[str, Any] = {"token2text": True, "experiment": EXPERIMENT,
                            "max_samples_per_step": 2}  # fmt: skip


def key(step: int, sample: int, rollout: int, *, validate: bool = False,
        done: bool = False, trajectory: str | None = None) -> dict[str, str]:  # fmt: skip
    headers = {"X-Rollout-Step": str(step), "X-Rollout-Sample-Index": str(sample),
               "X-Rollout-N": str(rollout),
               "X-Rollout-Validate": str(validate).lower()}  # fmt: skip
    if trajectory is not None:
        headers["X-Rollout-Trajectory-Id"] = trajectory
    if done:
        headers["X-Rollout-Done"] = "1"
    return headers


async def post(session: aiohttp.ClientSession, url: str, body: Any,
               headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    """The answer's JSON; a stream's events, each parsed, `[DONE]` left out."""
    async with session.post(url, json=body, headers=headers or {}) as response:
        data = await response.read()
        assert response.status == 200, (url, response.status, data[:500])
    if not data.startswith(b"data:"):
        return orjson.loads(data)
    events = [line[5:].strip() for line in data.split(b"\n") if line.startswith(b"data:")]
    return [orjson.loads(event) for event in events if event != b"[DONE]"]


async def chat_with_tools(session: aiohttp.ClientSession, proxy: str, question: str,
                          headers: dict[str, str], *, stream: bool = False) -> None:  # fmt: skip
    """A two-turn agent: the model calls a tool, gets its result (one of them an error), and
    answers; the last turn says the trajectory is done."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful agent. Use the tools."},
        {"role": "user", "content": question},
    ]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 24,
            "logprobs": True, "top_logprobs": 1, "seed": 7}  # fmt: skip
    answer = await post(session, proxy + "/v1/chat/completions", body, headers)
    message = answer["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    results = ['{"temp_c": 18, "sky": "clear"}' if i == 0 else "Error: tool timed out"
               for i in range(len(calls))]  # fmt: skip
    messages = [*messages, message] + [
        {"role": "tool", "tool_call_id": c["id"], "content": r}
        for c, r in zip(calls, results, strict=True)
    ]
    last = {**body, "messages": messages}
    if stream:
        last |= {"stream": True, "stream_options": {"include_usage": True}}
    await post(session, proxy + "/v1/chat/completions", last, {**headers, "X-Rollout-Done": "1"})


async def token_rollout(session: aiohttp.ClientSession, proxy: str, prompt: list[int],
                        headers: dict[str, str], *, stream: bool) -> None:  # fmt: skip
    """Token in, token out, as verl and slime call vLLM: the second turn's prompt is the first
    turn's prompt, its answer and a tool result's ids."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "logprobs": 1,
            "return_token_ids": True, "seed": 3, "stream": stream}  # fmt: skip
    answer = await post(session, proxy + "/v1/completions", body, headers)
    if stream:
        ids = [i for event in answer for c in event["choices"] for i in c.get("token_ids") or []]
    else:
        ids = answer["choices"][0]["token_ids"]
    second = {**body, "prompt": [*prompt, *ids, 198, 27, 14172, 29, 198]}
    await post(session, proxy + "/v1/completions", second, {**headers, "X-Rollout-Done": "1"})


async def vllm_run(session: aiohttp.ClientSession, proxy: str, admin: str,
                   flush: Callable[[], Awaitable[None]], answers: list[Any]) -> None:  # fmt: skip
    # Step 1: three samples of two rollouts, chat agents with tools; 2 samples are kept.
    for sample, question in enumerate(QUESTIONS):
        for rollout in range(2):
            await chat_with_tools(session, proxy, question, key(1, sample, rollout),
                                  stream=rollout == 1)  # fmt: skip
    # Rewards for the second rollouts once their calls were recorded (a reward and a call
    # travel apart, so a test that wants one order waits for the calls).
    await flush()
    for sample in (1, 2):  # (sample 0, sampled out, may still wait or be dropped by now)
        answers.append(await reward(session, admin, {
            "experiment": EXPERIMENT, "step": 1, "sample_index": sample, "rollout_n": 1,
            "reward": 0.25 * sample}))  # fmt: skip
    # The trainer pushes new weights between steps.
    for route, body in (("/pause?mode=abort", None), ("/start_weight_update", {}),
                        ("/update_weights", {"update_info": {}}),
                        ("/finish_weight_update", {"weight_version": "v2"}),
                        ("/resume", None)):  # fmt: skip
        async with session.post(proxy + route, json=body) as response:
            assert response.status == 200, route
    # Step 2: token-in rollouts through /v1/completions and /inference/v1/generate.
    for sample in range(3):
        prompt = [785, 6722, 315, 9625, 374, 100 + sample]
        await token_rollout(session, proxy, prompt, {**key(2, sample, 0)}, stream=False)
        await token_rollout(session, proxy, prompt, {**key(2, sample, 1)}, stream=True)
    for stream in (False, True):
        body = {"token_ids": [785, 6722, 315], "sampling_params": {"max_tokens": 6, "logprobs": 1},
                "return_token_ids": True, "stream": stream}  # fmt: skip
        await post(session, proxy + "/inference/v1/generate", body,
                   key(2, 0, 2 + stream, trajectory=f"generate-{stream}", done=True))  # fmt: skip
    # Validation at step 2: greedy, one rollout per sample.
    for sample in range(2):
        await chat_with_tools(session, proxy, QUESTIONS[sample],
                              key(2, 1000 + sample, 0, validate=True))  # fmt: skip
    # No metadata at all: a multi-turn chat and a batched text completion, placed by inference.
    await chat_with_tools(session, proxy, "Weather in Rome, please.", {})
    body = {"model": MODEL, "prompt": ["The capital of France is", "Two plus two is"],
            "max_tokens": 5, "n": 2, "seed": 11, "return_token_ids": True}  # fmt: skip
    await post(session, proxy + "/v1/completions", body)


async def reward(session: aiohttp.ClientSession, admin: str, body: dict[str, Any]) -> Any:
    async with session.post(admin + "/rewards", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def sglang_run(session: aiohttp.ClientSession, proxy: str) -> None:
    for stream in (False, True):
        body = {"input_ids": [785, 6722, 315], "sampling_params": {"max_new_tokens": 6},
                "return_logprob": True, "rid": f"traj-{stream}-turn-0",
                "stream": stream}  # fmt: skip
        await post(session, proxy + "/generate", body, key(1, 0, int(stream), done=True))
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
    await post(session, proxy + "/generate", body, key(1, 1, 0, done=True))
    for route, update in (("/pause_generation", {"mode": "abort"}),
                          ("/update_weights_from_distributed",
                           {"names": ["w"], "dtypes": ["bf16"], "shapes": [[2]],
                            "group_name": "g", "weight_version": "v2"}),
                          ("/continue_generation", {})):  # fmt: skip
        async with session.post(proxy + route, json=update) as response:
            assert response.status == 200, route
    await chat_with_tools(session, proxy, QUESTIONS[2], key(2, 0, 0), stream=True)
    body = {"input_ids": [[785, 6722], [9707, 1879]], "sampling_params": {"max_new_tokens": 4},
            "rid": ["a", "b"]}  # fmt: skip
    await post(session, proxy + "/generate", body)


async def run(tokenizer: Any, tokenizer_dir: str, output: Path) -> dict[str, list[Any]]:
    """Both runs, one call at a time; the late rewards' answers, by proxy."""
    vllm = FakeVLLM(tokenizer, model=MODEL, deterministic=True)
    sglang = FakeSGLang(tokenizer, model=MODEL, deterministic=True)
    settings = {**SETTINGS, "tokenizer": [tokenizer_dir]}
    answers: dict[str, list[Any]] = {"vllm": [], "sglang": []}
    async with (
        vllm.serve() as vllm_url,
        sglang.serve() as sglang_url,
        aiohttp.ClientSession(headers={"X-Rollout-Experiment": EXPERIMENT}) as session,
    ):
        async with running_proxy([vllm_url], output / "vllm", **settings) as (service, proxy):
            admin = service.addresses.admin if service.addresses else ""
            await vllm_run(session, proxy, admin, service.flush, answers["vllm"])
            await service.flush()  # every record written: what follows is late
            target = {"experiment": EXPERIMENT, "step": 1, "rollout_n": 0}
            for sample in range(3):  # one of the three was sampled out
                answers["vllm"].append(await reward(session, admin, {
                    **target, "sample_index": sample, "reward": 0.5 * sample,
                    "labels": {"judge": "exact"}}))  # fmt: skip
        async with running_proxy([sglang_url], output / "sglang", **settings) as (service, proxy):
            admin = service.addresses.admin if service.addresses else ""
            await sglang_run(session, proxy)
            await service.flush()
            answers["sglang"].append(await reward(session, admin, {
                "experiment": EXPERIMENT, "step": 1, "sample_index": 0, "rollout_n": 1,
                "score": 0.75}))  # fmt: skip
    return answers
