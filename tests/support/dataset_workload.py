"""A store for the export tests, made as a rollout makes one: two proxies (replicas of one
output) in front of the simulated vLLM, real Qwen tokenizer, token2text on.

Step 1: chat agents with tool calls and results (ids returned), one rollout per proxy, and one
trajectory whose two turns went to different proxies under one trajectory id. Step 2: token-in
agents through `/v1/completions` (tool calls in the decoded text, results as ChatML tokens),
rewarded with `done` while open; a chat agent without token ids and its twin (the same
question) with them; a validation rollout. Every chat rollout, closed by a `done` posted when
it answered, gets its reward after its record was written (late), posted to both proxies as a
trainer that does not know which holds it would (the one on both proxies: to the proxy of its
later turns only). What the agents sent and got back is kept,
to compare the export with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from support.proxies import running_proxy
from trace_proxy.demo.run import TOOLS, run_tool
from trace_proxy.demo.simulated_vllm import SimulatedVLLM

EXPERIMENT = "export"
MODEL = "qwen-sim"
Key = tuple[int, int, int, bool]  # step, sample, rollout, validate
QUESTIONS = ["Is it raining in Oslo?", "What is 17 * 23 + 4?", "Weather in Rome, please."]


@dataclass
class Sent:
    """What the agents sent and received, by (step, sample, rollout, validate)."""

    messages: dict[tuple[int, int, int, bool], list[dict[str, Any]]] = field(default_factory=dict)
    # token-in rollouts: each turn's prompt ids and the ids that came back
    turns: dict[tuple[int, int, int, bool], list[tuple[list[int], list[int]]]] = field(
        default_factory=dict
    )
    results: dict[tuple[int, int, int, bool], list[str]] = field(default_factory=dict)
    rewards: dict[tuple[int, int, int, bool], float] = field(default_factory=dict)


def headers(step: int, sample: int, rollout: int, validate: bool = False) -> dict[str, str]:
    return {"X-Rollout-Experiment": EXPERIMENT, "X-Rollout-Step": str(step),
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": str(rollout),
            "X-Rollout-Validate": str(validate).lower()}  # fmt: skip


async def post(session: aiohttp.ClientSession, url: str, body: Any, head: dict[str, str]) -> Any:
    async with session.post(url, json=body, headers=head) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def chat_agent(
    session: aiohttp.ClientSession,
    proxies: list[str],
    key: tuple[int, int, int, bool],
    sent: Sent,
    *,
    ids: bool = True,
    trajectory: str | None = None,
) -> None:
    """Ask, run the tools the model calls, until it answers; turn k goes to proxies[k % n]."""
    step, sample, rollout, validate = key
    head = headers(step, sample, rollout, validate)
    if trajectory is not None:
        head["X-Rollout-Trajectory-Id"] = trajectory
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful agent. Use the tools."},
        {"role": "user", "content": QUESTIONS[sample % len(QUESTIONS)]},
    ]
    results = sent.results.setdefault(key, [])
    for turn in range(6):
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS,
                                "max_tokens": 96, "seed": 5, "logprobs": True}  # fmt: skip
        if ids:
            body["return_token_ids"] = True
        answer = await post(session, proxies[turn % len(proxies)] + "/v1/chat/completions",
                            body, head)  # fmt: skip
        message = answer["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages.append({"role": "assistant", "content": message.get("content"),
                         "tool_calls": calls or None})  # fmt: skip
        if not calls:
            break
        for call in calls:
            result = run_tool(call["function"]["name"], call["function"]["arguments"])
            results.append(result)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    sent.messages[key] = messages


async def token_agent(
    session: aiohttp.ClientSession, proxy: str, tokenizer: Any, key: tuple[int, int, int, bool],
    sent: Sent,
) -> None:  # fmt: skip
    """verl's way: the prompt rendered once, then each turn's prompt is the last one, its
    answer's ids and the tool result's ChatML tokens."""
    step, sample, rollout, validate = key
    messages = [{"role": "system", "content": "You are a helpful agent. Use the tools."},
                {"role": "user", "content": QUESTIONS[sample % len(QUESTIONS)]}]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    turns, results = sent.turns.setdefault(key, []), sent.results.setdefault(key, [])
    for _ in range(6):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 96, "logprobs": 1,
                "return_token_ids": True, "seed": 9}  # fmt: skip
        answer = await post(session, proxy + "/v1/completions", body,
                            headers(step, sample, rollout, validate))  # fmt: skip
        output = answer["choices"][0]["token_ids"]
        turns.append((prompt, output))
        reply = tokenizer.decode(output)
        if "<tool_call>" not in reply:
            break
        call = json.loads(reply.split("<tool_call>")[1].split("</tool_call>")[0])
        result = run_tool(call["name"], json.dumps(call["arguments"]))
        results.append(result)
        added = (f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n")  # fmt: skip
        prompt = [*prompt, *output, *tokenizer.encode(added, add_special_tokens=False)]


def target(key: Key, options: dict[str, Any]) -> dict[str, Any]:
    """A reward's target: the trajectory id when the client gave one, else the key."""
    if options.get("trajectory") or options.get("trajectory_id"):
        return {"trajectory_id": options.get("trajectory") or options["trajectory_id"]}
    step, sample, rollout, validate = key
    return {"experiment": EXPERIMENT, "step": step, "sample_index": sample,
            "rollout_n": rollout, "validate": validate}  # fmt: skip


async def reward(session: aiohttp.ClientSession, admin: str, body: dict[str, Any]) -> None:
    async with session.post(admin + "/rewards", json=body) as response:
        assert response.status == 200, await response.text()


async def make_store(output: Path, tokenizer: Any, tokenizer_dir: str) -> Sent:
    """The store under `output` (`replicas/a`, `replicas/b`) and what was sent."""
    sent = Sent()
    settings = {"token2text": True, "tokenizer": [tokenizer_dir], "experiment": EXPERIMENT}
    server = SimulatedVLLM(tokenizer, model=MODEL, deterministic=True)
    async with (
        server.serve() as upstream,
        aiohttp.ClientSession() as session,
        running_proxy([upstream], output / "replicas" / "a", **settings) as (a, proxy_a),
        running_proxy([upstream], output / "replicas" / "b", **settings) as (b, proxy_b),
    ):
        admin_of = {proxy_a: a.addresses.admin if a.addresses else "",
                    proxy_b: b.addresses.admin if b.addresses else ""}  # fmt: skip

        async def chat(proxies: list[str], key: Key, **options: Any) -> None:
            """A chat rollout, then `done` posted (the agent knows when it answered)."""
            await chat_agent(session, proxies, key, sent, **options)
            for proxy in set(proxies):
                await reward(session, admin_of[proxy], {**target(key, options), "done": True})

        for sample in (0, 1):
            for rollout, proxy in enumerate((proxy_a, proxy_b)):
                await chat([proxy], (1, sample, rollout, False))
        await chat([proxy_a, proxy_b], (1, 2, 0, False), trajectory="both-proxies")
        for sample in (0, 1):
            key = (2, sample, 0, False)
            await token_agent(session, proxy_a, tokenizer, key, sent)
            sent.rewards[key] = 0.5 + sample  # given while it is open, closing it
            given = {**target(key, {}), "reward": sent.rewards[key], "done": True}
            await reward(session, admin_of[proxy_a], given)
        await chat([proxy_b], (2, 2, 0, False), ids=False)
        await chat([proxy_b], (2, 5, 0, False))  # the same question, with ids
        await chat([proxy_a], (2, 1000, 0, True))
        for service in (a, b):
            await service.flush()  # every record written: the rewards that follow are late
        for key in sent.messages:
            step, sample, rollout, _ = key
            sent.rewards[key] = round(0.1 * sample + 0.01 * rollout + 0.001 * step, 6)
            named = {"trajectory_id": "both-proxies"} if key == (1, 2, 0, False) else {}
            body = {**target(key, named), "reward": sent.rewards[key], "labels": {"judge": "late"}}
            # The trainer does not know which proxy holds a trajectory, so it asks both; the
            # one whose turns went to both is rewarded through the proxy of its later turns.
            admins = [admin_of[proxy_b]] if named else list(admin_of.values())
            for admin in admins:
                await reward(session, admin, body)
    return sent
