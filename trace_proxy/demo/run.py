"""`trace-proxy demo`: a small RL rollout through the proxy, with nothing external to set up.

A simulated vLLM server (real Qwen tokenizer, built offline) stands in for the GPU node; an
OpenAI-client agent plays samples x rollouts x steps of a multi-turn, tool-calling task through
the proxy, tagging each request with the `X-Rollout-*` headers; between steps the "trainer"
pushes new weights through the proxy (pause, update, finish with a version, resume), as verl or
slime would. Then the summary says what was recorded, where, and how to look at it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from trace_proxy.client import post_reward
from trace_proxy.config import Settings
from trace_proxy.demo.tasks import TASKS, TOOLS, reward_of, run_tool
from trace_proxy.proxy.service import ProxyService
from trace_proxy.store.readers import iter_records

MAX_TURNS = 6


async def rollout(
    client: Any, model: str, step: int, sample: int, rollout_n: int, stream: bool
) -> tuple[int, float]:
    """One trajectory: ask, call tools until the model answers; its turns and its reward."""
    headers = {
        "X-Rollout-Experiment": "demo",
        "X-Rollout-Step": str(step),
        "X-Rollout-Sample-Index": str(sample),
        "X-Rollout-N": str(rollout_n),
    }
    task = TASKS[sample % len(TASKS)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful agent. Use the tools."},
        {"role": "user", "content": task.question},
    ]
    for turn in range(1, MAX_TURNS + 1):
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 96,
            "temperature": 1.0,
            "seed": step * 10_000 + sample * 100 + rollout_n,  # sibling rollouts sample apart
            "logprobs": True,
            "extra_headers": headers,
            "extra_body": {"return_token_ids": True},
        }
        if stream:
            content, tool_calls = await _streamed_turn(client, kwargs)
        else:
            response = await client.chat.completions.create(**kwargs)
            message = response.choices[0].message
            content = message.content
            tool_calls = [tc.model_dump() for tc in message.tool_calls or []]
        messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls or None})
        if not tool_calls:
            return turn, reward_of(task, content)
        for call in tool_calls:
            fn = call["function"]
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": run_tool(fn["name"], fn["arguments"]),
                }
            )
    return MAX_TURNS, 0.0  # no answer within the turns allowed


async def _streamed_turn(client: Any, kwargs: dict[str, Any]) -> tuple[str | None, list[Any]]:
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    stream = await client.chat.completions.create(stream=True, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                parts.append(delta.content)
            for fragment in delta.tool_calls or []:
                entry = calls.setdefault(
                    fragment.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                entry["id"] = fragment.id or entry["id"]
                if fragment.function is not None:
                    entry["function"]["name"] += fragment.function.name or ""
                    entry["function"]["arguments"] += fragment.function.arguments or ""
    return ("".join(parts) or None), [calls[i] for i in sorted(calls)]


async def push_weights(proxy_url: str, version: str) -> None:
    """What a trainer does between steps; the proxy records each call as a step event."""
    headers = {"X-Rollout-Experiment": "demo"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for path, body in (
            ("/pause", None),
            ("/start_weight_update", {}),
            ("/update_weights", {"update_info": {}}),
            ("/finish_weight_update", {"weight_version": version}),
            ("/resume", None),
        ):
            async with session.post(proxy_url + path, json=body) as response:
                response.raise_for_status()


async def run_demo(settings: Settings, samples: int = 4, rollouts: int = 2, steps: int = 2) -> int:
    from openai import AsyncOpenAI

    from trace_proxy.demo.simulated_vllm import SimulatedVLLM
    from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer, load_qwen_tokenizer

    started = time.monotonic()
    print(
        "trace-proxy demo: loading the Qwen tokenizer (built offline on first use)...", flush=True
    )
    tokenizer = await asyncio.to_thread(load_qwen_tokenizer)
    simulator = SimulatedVLLM(tokenizer=tokenizer, model="qwen-sim", token_delay=0.001)
    sim_runner, upstream = await simulator.start()
    settings = dataclasses.replace(
        settings,
        upstream=[upstream],
        port=0,
        admin_port=0,
        token2text=True,  # the demo has its tokenizer at hand: show the decoded text too
        step_close_grace=0.0,  # synchronous RL: a step's rollouts are over before new weights
        tokenizer=settings.tokenizer or [str(ensure_qwen_tokenizer())],
    )
    service = ProxyService(settings)
    try:
        addresses = await service.start()
        await service.wait_ready()  # the demo shows the decoded text: wait for the tokenizer
    except BaseException:
        await service.stop()
        await sim_runner.cleanup()
        raise
    print(f"  simulated vLLM at {upstream}; trace-proxy at {addresses.proxy}", flush=True)
    client = AsyncOpenAI(base_url=addresses.proxy + "/v1", api_key="demo-key-never-recorded")
    turns = 0
    try:
        for step in range(1, steps + 1):
            results = await asyncio.gather(
                *(
                    rollout(client, "qwen-sim", step, sample, n, stream=(sample + n) % 2 == 1)
                    for sample in range(samples)
                    for n in range(rollouts)
                )
            )
            # The verifier's rewards, posted as a trainer would (trace_proxy.client.post_reward)
            # as soon as the step's answers are back: a reward waits for the calls forwarded
            # before it to be parsed, so it finds its trajectory.
            keys = [(sample, n) for sample in range(samples) for n in range(rollouts)]
            admin = str(addresses.admin)
            posts = [
                functools.partial(post_reward, admin, reward=reward, experiment="demo",
                                  step=step, sample_index=sample, rollout_n=n)
                for (sample, n), (_, reward) in zip(keys, results, strict=True)
            ]  # fmt: skip
            await asyncio.gather(*(asyncio.to_thread(post) for post in posts))
            calls = sum(t for t, _ in results)
            turns += calls
            mean = sum(r for _, r in results) / len(results)
            print(f"  step {step}: {len(results)} rollouts, {calls} model calls, "
                  f"mean reward {mean:.2f}", flush=True)  # fmt: skip
            if step < steps:
                await push_weights(addresses.proxy, f"v{step + 1}")
    finally:
        await client.close()
        await service.stop()
        await sim_runner.cleanup()
    _summarize(settings.output, time.monotonic() - started, turns)
    return 0


def _summarize(output: Path, seconds: float, turns: int) -> None:
    trajectories = calls = tool_calls = 0
    events: Counter[str] = Counter()
    files: set[Path] = set()
    for path, record in iter_records(output):
        files.add(path)
        if record.get("record") == "event":
            events[record["event"]] += 1
            continue
        if (record.get("key") or {}).get("experiment") != "demo":
            continue
        trajectories += 1
        calls += len(record["calls"])
        tool_calls += sum(
            len(o.get("tool_calls") or []) for c in record["calls"] for o in c.get("outputs") or []
        )
    print(
        f"\nRecorded {trajectories} trajectories with {calls} generate calls "
        f"({tool_calls} tool calls requested by the model) in {seconds:.1f} s; "
        f"the agent made {turns} calls."
    )
    if events:
        print("Step events: " + ", ".join(f"{n}x {e}" for e, n in sorted(events.items())))
    print(f"Store: {output}/ ({len(files)} files, one trajectory per line)")
    for path in sorted(files):
        print(f"  {path}")
    print(f"\nLook at them:  trace-proxy show {output}")
    print(f"One step only: trace-proxy show {output} --step 1")
    print(f"In a browser:  trace-proxy ui {output}")
