"""Bytes stored per trajectory: trace-proxy's records against a per-call tracer and the transcript.

A per-call tracer (verl's rollout trace, most OpenTelemetry setups) stores every turn's full
prompt, so a trajectory costs turns x tokens. trace-proxy stores a turn's prompt as a reference
to the previous turn plus the new suffix. This runs 20-turn tool-calling trajectories in the
token-in/token-out style of RL agent loops (prompt N+1 = prompt N + response N + tool result)
through a real proxy in front of the simulated vLLM server, with token2text on, and compares:

- stored: the jsonl bytes trace-proxy wrote for the trajectories;
- per-call: the same records with every prompt (ids and decoded text) stored whole;
- transcript: the final context itself, its token ids and its text, as JSON.

With `--chat` the same loop runs over `/v1/chat/completions` with the OpenAI SDK, each reply
sent back as the SDK's `choice.message` and each test log as the next user message.

    python benchmarks/volume.py [--trajectories 8] [--turns 20] [--log-lines 40] [--logprobs]
                                [--chat]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from openai import AsyncOpenAI

from trace_proxy.config import Settings
from trace_proxy.demo.simulated_vllm import SimulatedVLLM
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer, load_qwen_tokenizer
from trace_proxy.proxy.service import ProxyService
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.prompts import expand_prompts, transcript_of

SYSTEM = "You are a coding agent. Use the tools to inspect and fix the repository."


async def run_trajectory(
    session: aiohttp.ClientSession, proxy: str, tokenizer: Any, index: int, turns: int,
    logprobs: bool, log_lines: int,
) -> None:  # fmt: skip
    """One agent loop in token space, like verl's ToolAgentLoop over /inference/v1/generate."""
    prompt = tokenizer.encode(
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"Task {index}: make the failing test number {index} pass.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    headers = {"X-Rollout-Trajectory-Id": f"volume-{index}"}
    for turn in range(turns):
        if turn == turns - 1:
            headers["X-Rollout-Done"] = "true"
        params: dict[str, Any] = {"max_tokens": 96, "temperature": 1.0}
        if logprobs:
            params["logprobs"] = 1
        body = {"token_ids": prompt, "sampling_params": params, "return_token_ids": True}
        async with session.post(
            proxy + "/inference/v1/generate", json=body, headers=headers
        ) as response:
            reply = await response.json()
        output = reply["choices"][0]["token_ids"]
        log = _log(index, turn, log_lines)
        result = (
            f"\n<|im_start|>user\n<tool_response>\n{log}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        prompt = prompt + output + tokenizer.encode(result)


async def run_chat_trajectory(
    client: Any, index: int, turns: int, logprobs: bool, log_lines: int
) -> None:
    """The same agent loop over chat: the SDK's reply object goes back as it came."""
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {index}: make the failing test number {index} pass."},
    ]
    headers = {"X-Rollout-Trajectory-Id": f"volume-{index}"}
    for turn in range(turns):
        if turn == turns - 1:
            headers["X-Rollout-Done"] = "true"
        reply = await client.chat.completions.create(
            model="qwen-sim", messages=messages, max_tokens=96, temperature=1.0,
            logprobs=logprobs, extra_headers=headers, extra_body={"return_token_ids": True},
        )  # fmt: skip
        messages.append(reply.choices[0].message)
        messages.append({"role": "user", "content": _log(index, turn, log_lines)})


def _log(index: int, turn: int, log_lines: int) -> str:
    return "\n".join(
        f"tests/test_{index}.py::test_case_{turn}_{line} "
        + ("PASSED" if (line + turn) % 7 else f"FAILED (assert {line} == {turn})")
        for line in range(log_lines)
    )


def measure(output: Path) -> dict[str, float]:
    stored = per_call = transcript = 0
    count = 0
    for _, record in iter_records(output):
        if record.get("record") != "trajectory":
            continue
        count += 1
        stored += len(orjson.dumps(record)) + 1
        whole = dict(record)
        full = expand_prompts(record)
        whole["calls"] = [
            {**call, "prompt": prompt, "prompt_text": _decoded_whole(record, i)}
            for i, (call, prompt) in enumerate(zip(record["calls"], full, strict=True))
        ]
        per_call += len(orjson.dumps(whole)) + 1
        last = record["calls"][-1]
        final_ids = full[-1]["token_ids"] + (last["outputs"][0]["token_ids"] or [])
        text = transcript_of(record)
        transcript += len(orjson.dumps({"token_ids": final_ids, "text": text}))
    return {
        "trajectories": count,
        "stored": stored,
        "per_call": per_call,
        "transcript": transcript,
    }


def _decoded_whole(record: dict[str, Any], position: int) -> str:
    """A call's whole prompt as text: the stored suffixes and responses up to it, joined."""
    calls = record["calls"]
    text = ""
    for i in range(position + 1):
        call = calls[i]
        if i == 0 or call["prompt"]["prefix_call"] is None:
            text = call["prompt_text"] or ""
        else:
            previous = calls[i - 1]["outputs"][0].get("response_text") or ""
            text = text + previous + (call["prompt_text"] or "")
    return text


async def main(args: argparse.Namespace) -> int:
    tokenizer = await asyncio.to_thread(load_qwen_tokenizer)
    simulator = SimulatedVLLM(tokenizer=tokenizer, model="qwen-sim", deterministic=True)
    runner, upstream = await simulator.start()
    output = Path(tempfile.mkdtemp(prefix="trace-proxy-volume-"))
    settings = Settings(
        upstream=[upstream], port=0, admin_port=0, output=output, token2text=True,
        tokenizer=[str(ensure_qwen_tokenizer())],
    )  # fmt: skip
    started = time.monotonic()
    async with ProxyService(settings) as service, aiohttp.ClientSession() as session:
        assert service.addresses is not None
        proxy = service.addresses.proxy
        if args.chat:
            client = AsyncOpenAI(base_url=proxy + "/v1", api_key="none")
            await asyncio.gather(*(
                run_chat_trajectory(client, i, args.turns, args.logprobs, args.log_lines)
                for i in range(args.trajectories)
            ))  # fmt: skip
            await client.close()
        else:
            await asyncio.gather(*(
                run_trajectory(session, proxy, tokenizer, i, args.turns, args.logprobs,
                               args.log_lines)
                for i in range(args.trajectories)
            ))  # fmt: skip
    await runner.cleanup()
    sizes = measure(output)
    command = "python benchmarks/volume.py " + " ".join(sys.argv[1:])
    print(f"`{command.strip()}` ({time.monotonic() - started:.1f} s)\n")
    print("| route | trajectories x turns | logprobs | stored | stored / trajectory "
          "| per-call tracer | transcript (ids + text) | stored / transcript "
          "| per-call / stored |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {'chat' if args.chat else 'generate'} "
        f"| {sizes['trajectories']} x {args.turns} | {'yes' if args.logprobs else 'no'} "
        f"| {sizes['stored'] / 1024:.0f} KiB | {sizes['stored'] / sizes['trajectories']:.0f} B "
        f"| {sizes['per_call'] / 1024:.0f} KiB "
        f"| {sizes['transcript'] / 1024:.0f} KiB | {sizes['stored'] / sizes['transcript']:.2f} "
        f"| {sizes['per_call'] / sizes['stored']:.1f} |"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--logprobs", action="store_true", help="also record sampled logprobs")
    parser.add_argument("--chat", action="store_true", help="chat completions with the OpenAI SDK")
    parser.add_argument(
        "--log-lines", type=int, default=40, help="lines of test log per tool result"
    )
    sys.exit(asyncio.run(main(parser.parse_args())))
