"""A ground-truth RL run through trace-proxy: who sent what, known exactly.

Two simulated RL runs go on at once, one on vLLM and one on SGLang, each with its own proxy in
front of its fake (as each inference server gets its own sidecar). Each run has the shape of a
GRPO training loop:

    step 0 rollouts -> pause(abort) + weight update v1 + resume -> step 1 rollouts
    -> pause(abort) + weight update v2 + resume -> validation pass (step 2, greedy, n = 1)

Every step has, per dialect variant, `SAMPLES` prompts x `N` rollouts running concurrently
(interleaved calls, 1-5 turns, parallel tool calls, tool errors). Some token rollouts are
interrupted AReaL-style: aborted mid-generation by the pause at a weight update (and resumed
after it, while the next step is already running) or by the abort route, then re-POSTed with
prompt + partial output. With `with_headers`, every call carries its full key: in `X-Rollout-*`
headers, or for one trajectory in five in W3C `baggage` and for one in five in the
`/rollout/...` path prefix; without, nothing but the traffic says where a call belongs.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from support.proxies import running_proxy, trajectories

from groundtruth.agents import (
    MAX_TOKENS,
    Backend,
    Batch,
    Interrupt,
    Rollout,
    Variant,
    run_rollout,
)
from groundtruth.clients import Sampling
from groundtruth.model import WORDS, build_fakes
from groundtruth.truth import TrueTrajectory, Truth

VARIANTS = (
    Variant("vllm.chat", "vllm", "chat"),
    Variant("vllm.chat.stream", "vllm", "chat", stream=True),
    Variant("vllm.completions", "vllm", "completions"),
    Variant("vllm.completions.stream", "vllm", "completions", stream=True),
    Variant("vllm.completions.areal", "vllm", "completions", areal=True),
    Variant("vllm.completions.text", "vllm", "completions", text=True),
    Variant("vllm.completions.text.batched", "vllm", "completions", text=True, batched=True),
    Variant("vllm.generate", "vllm", "vllm_generate"),
    Variant("vllm.generate.stream", "vllm", "vllm_generate", stream=True),
    Variant("sglang.generate", "sglang", "sglang_generate"),
    Variant("sglang.generate.stream", "sglang", "sglang_generate", stream=True),
    Variant("sglang.chat", "sglang", "chat"),
    Variant("sglang.chat.stream", "sglang", "chat", stream=True),
)
TRAIN_STEPS = 2
SAMPLES = 3  # prompts per variant per training step
N = 4  # rollouts per prompt (GRPO group size)
VAL_SAMPLES = 4
CONCURRENCY = 48  # rollouts in flight per backend
EXPERIMENT = "groundtruth"
SYSTEM = "You are a research agent. Use the tools when they help, then answer briefly."
# Token rollouts interrupted per step: (sample position, rollout, Interrupt(turn, tokens, kind)).
INTERRUPTS = {
    0: ((0, 0, 0, 5, "update"), (1, 1, 1, 7, "abort")),
    1: ((2, 2, 0, 3, "abort"), (1, 3, 1, 4, "update")),
}


@dataclass
class Phase:
    step: int
    validate: bool
    rollouts: list[Rollout]


def _stable(*parts: object) -> int:
    data = "\0".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


def _messages(variant: Variant, dataset_index: int) -> list[dict[str, Any]]:
    rng = random.Random(_stable("prompt", variant.name, dataset_index))
    topic = " ".join(rng.choice(WORDS) for _ in range(3))
    question = f"Task {dataset_index} ({variant.name}): what do we know about {topic}?"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _key(truth: TrueTrajectory) -> dict[str, str]:
    return {
        "experiment": EXPERIMENT,
        "step": str(truth.step),
        "sample_index": str(truth.sample_index),
        "n": str(truth.rollout_n),
        "validate": "true" if truth.validate else "false",
        "trajectory_id": truth.id,
    }


def _carrier(truth: TrueTrajectory) -> tuple[dict[str, str], str]:
    """(headers, path prefix) that carry a trajectory's full key, in one of three ways."""
    key = _key(truth)
    way = _stable("carrier", truth.id) % 5
    if way == 0:
        return {"baggage": ",".join(f"rollout.{k}={v}" for k, v in key.items())}, ""
    if way == 1:
        return {}, "/rollout/" + "/".join(f"{k}={v}" for k, v in key.items())
    names = {"n": "N", "sample_index": "Sample-Index", "trajectory_id": "Trajectory-Id"}
    return {f"X-Rollout-{names.get(k, k.title())}": v for k, v in key.items()}, ""


def _dataset(step: int, validate: bool) -> list[int]:
    """Dataset indices of a phase; step 1 sees step 0's first prompt again (a second epoch)."""
    if validate:
        return [1000 + k for k in range(VAL_SAMPLES)]
    return (
        [0, *range(SAMPLES * step + 1, SAMPLES * step + SAMPLES)] if step else list(range(SAMPLES))
    )


def plan_phase(variants: list[Variant], step: int, validate: bool, with_headers: bool) -> Phase:
    """Every rollout of one phase: per variant, its prompts x N rollouts (1 when validating)."""
    rollouts = [
        _rollout(variant, 10_000 * v_index + index, position, r, step, validate, with_headers)
        for v_index, variant in enumerate(variants)
        for position, index in enumerate(_dataset(step, validate))
        for r in range(1 if validate else N)
    ]
    if not with_headers:  # headers name one trajectory: a batch cannot carry several
        _batch_first_turns(rollouts, step, validate)
    return Phase(step, validate, rollouts)


def _batch_first_turns(rollouts: list[Rollout], step: int, validate: bool) -> None:
    """Batched variants: rollout r of every sample of the phase share one first request."""
    members: dict[tuple[str, int], list[Rollout]] = {}
    for rollout in rollouts:
        if rollout.variant.batched:
            members.setdefault((rollout.variant.name, rollout.truth.rollout_n), []).append(rollout)
    for (name, r), batch in members.items():
        seed = None if validate else _stable("batch", name, step, r)
        shared = Batch(len(batch), seed)
        for rollout in batch:
            rollout.batch = shared


def _rollout(
    variant: Variant,
    sample_index: int,
    position: int,
    r: int,
    step: int,
    validate: bool,
    with_headers: bool,
) -> Rollout:
    index = sample_index % 10_000
    truth = TrueTrajectory(
        id=f"{variant.name}-{'val' if validate else 'train'}{step}-i{index}-n{r}",
        variant=variant.name,
        backend=variant.backend,
        step=step,
        validate=validate,
        sample_index=sample_index,
        rollout_n=r,
        group=f"{variant.name}/{step}/{validate}/{index}",
    )
    # Rollouts of a group differ by their seed (sampling); validation is greedy.
    seed = None if validate else _stable(truth.id)
    sampling = Sampling(MAX_TOKENS, 0.0 if validate else 1.0, seed)
    headers, prefix = _carrier(truth) if with_headers else ({}, "")
    interrupt = _interrupt(variant, step, validate, position, r)
    return Rollout(truth, variant, _messages(variant, index), sampling, headers, prefix, interrupt)


def _interrupt(
    variant: Variant, step: int, validate: bool, position: int, r: int
) -> Interrupt | None:
    """AReaL interrupts token generates only; see INTERRUPTS."""
    if validate or not variant.tokens or variant.text:
        return None
    for pos, rollout, turn, tokens, kind in INTERRUPTS.get(step, ()):
        if (pos, rollout) == (position, r):
            return Interrupt(turn, tokens, kind)
    return None


def plan_backend(backend: str, with_headers: bool) -> list[Phase]:
    variants = [v for v in VARIANTS if v.backend == backend]
    phases = [plan_phase(variants, step, False, with_headers) for step in range(TRAIN_STEPS)]
    return [*phases, plan_phase(variants, TRAIN_STEPS, True, with_headers)]


async def control(backend: Backend, route: str, body: dict[str, Any] | None) -> None:
    """A trainer's control call, through the proxy like everything else."""
    async with backend.session.post(backend.url + route, json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{route}: HTTP {response.status}")


def _update_calls(backend: str, version: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Pause (aborting what runs), push weights, resume: vLLM's RL routes or SGLang's."""
    if backend == "vllm":
        return [
            ("/pause?mode=abort", None),
            ("/start_weight_update", {}),
            ("/update_weights", {"update_info": {}}),
            ("/finish_weight_update", {"weight_version": version}),
            ("/resume", None),
        ]
    update = {
        "names": ["layer.0.weight"],
        "dtypes": ["bfloat16"],
        "shapes": [[8, 8]],
        "group_name": "actor",
        "flush_cache": True,
        "weight_version": version,
    }
    return [
        ("/pause_generation", {"mode": "abort"}),
        ("/update_weights_from_distributed", update),
        ("/continue_generation", {}),
    ]


async def weight_update(backend: Backend, version: str) -> None:
    """The trainer pushes new weights; interrupted agents wait until generation reopens."""
    backend.generation_open.clear()
    for route, body in _update_calls(backend.name, version):
        await control(backend, route, body)
    backend.generation_open.set()


async def drive(backend: Backend, phases: list[Phase]) -> None:
    """The trainer's loop: run a phase, push weights, go on while the rollouts the pause
    interrupted finish alongside the next phase."""
    limit = asyncio.Semaphore(CONCURRENCY)
    backend.generation_open.set()
    carried: list[asyncio.Future[None]] = []
    for phase in phases:
        carried = await _run_phase(backend, phase, carried, limit)
        if not phase.validate:
            await weight_update(backend, f"v{phase.step + 1}")
    await asyncio.gather(*carried)


async def _run_phase(
    backend: Backend,
    phase: Phase,
    carried: list[asyncio.Future[None]],
    limit: asyncio.Semaphore,
) -> list[asyncio.Future[None]]:
    """Start a phase; return when everything has finished but the rollouts the coming pause
    will interrupt, which are then stalled mid-generation (returned, still running)."""
    paused: list[tuple[Rollout, asyncio.Future[None]]] = []
    others: list[tuple[Rollout, asyncio.Future[None]]] = []
    for rollout in phase.rollouts:
        if rollout.interrupt is not None:
            backend.engine.gate(rollout.interrupt.marker, rollout.interrupt.tokens)
        task = asyncio.ensure_future(_limited(backend, rollout, limit))
        pausable = rollout.interrupt is not None and rollout.interrupt.kind == "update"
        (paused if pausable else others).append((rollout, task))
    await asyncio.gather(*(task for _, task in others), *carried)
    for rollout, _ in paused:
        assert rollout.interrupt is not None
        await backend.engine.stalled(rollout.interrupt.marker)
    return [task for _, task in paused]


async def _limited(backend: Backend, rollout: Rollout, limit: asyncio.Semaphore) -> None:
    async with limit:
        await run_rollout(backend, rollout)


async def run_mode(
    tokenizer: Any, tokenizer_dir: str, output: Path, with_headers: bool
) -> tuple[Truth, list[dict[str, Any]]]:
    """Run both simulated RL runs through two proxies; returns the truth and the records."""
    vllm, sglang, vllm_engine, sglang_engine = build_fakes(tokenizer)
    settings = {"token2text": True, "tokenizer": [tokenizer_dir], "experiment": EXPERIMENT}
    plans = {name: plan_backend(name, with_headers) for name in ("vllm", "sglang")}
    truth = Truth([r.truth for phases in plans.values() for p in phases for r in p.rollouts])
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        vllm.serve() as vllm_url,
        sglang.serve() as sglang_url,
        running_proxy([vllm_url], output / "vllm", **settings) as (_, vllm_proxy),
        running_proxy([sglang_url], output / "sglang", **settings) as (_, sglang_proxy),
        aiohttp.ClientSession(connector=connector) as session,
    ):
        backends = [
            Backend("vllm", vllm_proxy, session, vllm_engine, tokenizer),
            Backend("sglang", sglang_proxy, session, sglang_engine, tokenizer),
        ]
        await asyncio.gather(*(drive(b, plans[b.name]) for b in backends))
    records = trajectories(output / "vllm") + trajectories(output / "sglang")
    return truth, records
