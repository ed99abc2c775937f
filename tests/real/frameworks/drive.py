"""Run one RL framework's own client code against a server, in the frameworks venv.

    python drive.py [--group N] CLIENT MODEL_DIR OUT.json URL [URL ...]

CLIENT is one of `CLIENTS`. Each URL is where the framework is pointed: the inference server
itself (direct) or trace-proxy in front of it; that address is the only thing that changes
between the runs, which go one after the other in one process (the frameworks take seconds to
import). Each client plays the same small GRPO-shaped workload through the framework's
public client API: `SAMPLES` prompts, the first with two rollouts, `TURNS` turns each (turn
N+1's prompt is turn N's prompt, the reply and an environment turn), greedy so that a run is
reproducible. With `--group N`: one prompt, a GRPO group of N rollouts sampled at temperature
1 (their replies differ, and only the replies tell their next turns apart). What every call gave
back, as the framework handed it over, is written to OUT.json with the workload (the truth the
store is checked against), one run per URL.

Nothing here talks HTTP itself: every request is the framework's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import typing_extensions

# SkyRL needs Python 3.12's typing.TypedDict (generic TypedDicts); this venv may be 3.11.
typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

SAMPLES = 3
TURNS = 2
MAX_NEW_TOKENS = 8
ENVIRONMENT = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ("What is the capital of France?", "Name a prime number.", "Say hello.")
ROLLOUTS = {0: 2}  # sample -> rollouts (1 when not listed)


@dataclass(frozen=True)
class Workload:
    samples: int = SAMPLES
    rollouts: dict[int, int] = field(default_factory=lambda: dict(ROLLOUTS))
    temperature: float = 0.0  # greedy


def group(rollouts: int) -> Workload:
    return Workload(samples=1, rollouts={0: rollouts}, temperature=1.0)


Generate = Callable[[list[list[int]], list[str]], Awaitable[list[dict[str, Any]]]]


def _tokenizer(model_dir: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _first_prompt(tok: Any, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(text, add_special_tokens=False))


# --- clients ------------------------------------------------------------------------------------


def _hostport(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


async def areal(
    backend: str, url: str, tok: Any, temperature: float
) -> tuple[Generate, Callable[[], Any]]:
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.api.io_struct import ModelRequest

    if backend == "vllm":
        from areal.engine.vllm_remote import RemotevLLMEngine as Engine
    else:
        from areal.engine.sglang_remote import RemoteSGLangEngine as Engine
    engine = Engine(InferenceEngineConfig(experiment_name=None, trial_name=None))
    await asyncio.to_thread(engine.initialize, addr=_hostport(url), train_data_parallel_size=1)

    async def generate(prompts: list[list[int]], _sessions: list[str]) -> list[dict[str, Any]]:
        if temperature == 0.0:
            gconfig = GenerationHyperparameters(max_new_tokens=MAX_NEW_TOKENS, greedy=True)
        else:
            gconfig = GenerationHyperparameters(
                max_new_tokens=MAX_NEW_TOKENS, temperature=temperature
            )
        requests = [ModelRequest(input_ids=p, gconfig=gconfig, tokenizer=tok) for p in prompts]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        return [
            {
                "output_ids": list(r.output_tokens),
                "logprobs": list(r.output_logprobs),
                "stop": r.stop_reason,
            }
            for r in responses
        ]

    return generate, engine.destroy


async def skyrl(url: str, tok: Any, temperature: float) -> tuple[Generate, Callable[[], Any]]:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )

    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name="tiny-qwen"
    )
    finished: list[str] = []

    async def generate(prompts: list[list[int]], sessions: list[str]) -> list[dict[str, Any]]:
        out = await client.generate(
            {
                "prompt_token_ids": prompts,
                "session_ids": sessions,
                "sampling_params": {
                    "max_tokens": MAX_NEW_TOKENS,
                    "temperature": temperature,
                    "logprobs": 0,
                },
            }
        )
        return [
            {"output_ids": list(ids), "text": text, "stop": stop}
            for ids, text, stop in zip(
                out["response_ids"], out["responses"], out["stop_reasons"], strict=True
            )
        ]

    async def finish(sessions: list[str]) -> None:
        for session in sessions:
            await client.finish_session(session)
            finished.append(session)

    generate.finish = finish  # type: ignore[attr-defined]

    async def close() -> None:
        await client.aclose() if hasattr(client, "aclose") else None

    return generate, close


async def skyrl_train(
    backend: str, url: str, tok: Any, temperature: float
) -> tuple[Generate, Callable[[], Any]]:
    from skyrl_train.inference_engines.remote_inference_engine import RemoteInferenceEngine

    engine = RemoteInferenceEngine(
        url=_hostport(url), model_name="tiny-qwen", engine_backend=backend, tokenizer=tok
    )

    async def generate(prompts: list[list[int]], _sessions: list[str]) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"temperature": temperature}
        params["max_tokens" if backend == "vllm" else "max_new_tokens"] = MAX_NEW_TOKENS
        out = await engine.generate({"prompt_token_ids": prompts, "sampling_params": params})
        return [
            {"output_ids": list(ids), "text": text, "stop": stop}
            for ids, text, stop in zip(
                out["response_ids"], out["responses"], out["stop_reasons"], strict=True
            )
        ]

    return generate, lambda: None


async def openai_chat(
    url: str, tok: Any, temperature: float, session_path: bool = False
) -> tuple[Generate, Callable[[], Any]]:
    """An agent on the OpenAI SDK: one conversation per rollout, the second turn streamed.
    With `session_path` (rllm's model gateway), each rollout's base URL names its session and
    the agent adds `X-Session-ID`, which the gateway passes on."""
    from openai import AsyncOpenAI

    clients: dict[str, AsyncOpenAI] = {}
    conversations: dict[str, list[dict[str, Any]]] = {}

    def client_for(session: str) -> AsyncOpenAI:
        if session not in clients:
            base = f"{url}/sessions/{session}/v1" if session_path else f"{url}/v1"
            headers = {"X-Session-ID": session} if session_path else {}
            clients[session] = AsyncOpenAI(base_url=base, api_key="none", default_headers=headers)
        return clients[session]

    async def one(session: str) -> dict[str, Any]:
        messages = conversations[session]
        client = client_for(session)
        extra = {"return_token_ids": True}
        if len(messages) == 1:
            reply = await client.chat.completions.create(
                model="tiny-qwen",
                messages=messages,
                max_tokens=MAX_NEW_TOKENS,
                temperature=temperature,
                logprobs=True,
                extra_body=extra,
            )
            choice = reply.choices[0]
            text, stop = choice.message.content or "", choice.finish_reason
            ids = (choice.model_extra or {}).get("token_ids")
        else:
            stream = await client.chat.completions.create(
                model="tiny-qwen",
                messages=messages,
                max_tokens=MAX_NEW_TOKENS,
                temperature=temperature,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            text, stop, ids = "", None, None
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    stop = choice.finish_reason or stop
                    more = (choice.model_extra or {}).get("token_ids")
                    if more is not None:
                        ids = [*(ids or []), *more]
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": "Go on."})
        return {"output_ids": ids, "text": text, "stop": stop}

    async def generate(prompts: list[list[int]], sessions: list[str]) -> list[dict[str, Any]]:
        for prompt, session in zip(prompts, sessions, strict=True):
            if session not in conversations:  # the question, as the prompt was made from it
                conversations[session] = [{"role": "user", "content": _question_of(tok, prompt)}]
        return list(await asyncio.gather(*(one(s) for s in sessions)))

    generate.chat = True  # type: ignore[attr-defined]

    async def close() -> None:
        for client in clients.values():
            await client.close()

    return generate, close


def _question_of(tok: Any, prompt: list[int]) -> str:
    for question in QUESTIONS:
        if _first_prompt(tok, question) == prompt:
            return question
    raise ValueError("not one of the workload's first prompts")


Client = Callable[[str, Any, float], Awaitable[tuple[Generate, Callable[[], Any]]]]
CLIENTS: dict[str, Client] = {  # (url, tokenizer, temperature) -> generate, close
    "areal-vllm": lambda url, tok, t: areal("vllm", url, tok, t),
    "areal-sglang": lambda url, tok, t: areal("sglang", url, tok, t),
    "skyrl": skyrl,
    "skyrl-train-vllm": lambda url, tok, t: skyrl_train("vllm", url, tok, t),
    "skyrl-train-sglang": lambda url, tok, t: skyrl_train("sglang", url, tok, t),
    "openai": openai_chat,
    "rllm-gateway": lambda url, tok, t: openai_chat(url, tok, t, session_path=True),
}


# --- the workload -------------------------------------------------------------------------------


async def run(client: str, url: str, model_dir: str, workload: Workload) -> dict[str, Any]:
    tok = _tokenizer(model_dir)
    generate, close = await CLIENTS[client](url, tok, workload.temperature)
    rollouts = [
        {"sample": s, "rollout": r, "session": f"{s}_{r}", "turns": []}
        for s in range(workload.samples)
        for r in range(workload.rollouts.get(s, 1))
    ]
    prompts = [_first_prompt(tok, QUESTIONS[r["sample"]]) for r in rollouts]
    environment = list(tok.encode(ENVIRONMENT, add_special_tokens=False))
    try:
        for _ in range(TURNS):
            # One batch per turn, as the trainers send a step's rollouts together.
            results = await generate(prompts, [r["session"] for r in rollouts])
            chat = getattr(generate, "chat", False)  # its prompts are messages, kept by it
            for rollout, prompt, result in zip(rollouts, prompts, results, strict=True):
                rollout["turns"].append({"prompt_ids": None if chat else prompt, **result})
            if not chat:
                prompts = [
                    [*p, *r["output_ids"], *environment]
                    for p, r in zip(prompts, results, strict=True)
                ]
        finish = getattr(generate, "finish", None)
        if finish is not None:
            await finish([r["session"] for r in rollouts])
    finally:
        done = close()
        if asyncio.iscoroutine(done):
            await done
    return {"client": client, "rollouts": rollouts}


def main() -> int:
    args = sys.argv[1:]
    workload = Workload()
    if args[0] == "--group":
        workload = group(int(args[1]))
        args = args[2:]
    client, model_dir, out, *urls = args
    results = [asyncio.run(run(client, url, model_dir, workload)) for url in urls]
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
