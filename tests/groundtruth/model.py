"""The simulated policy behind the ground-truth run: a scripted model and a stallable engine.

The fakes' own model answers one tool call per turn; an RL rollout needs more: parallel tool
calls, 1-5 turns decided turn by turn, answers that differ between the rollouts of one GRPO
group, and a generation that continues where it stopped when AReaL re-POSTs prompt + partial
output. `ScriptedText` replaces the fakes' `TextModel` for that; `GatedEngine` holds chosen
requests after a few tokens, so a pause or abort lands mid-generation deterministically
(no timing races, no sleeps).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterable, Sequence
from typing import Any

from fakes import FakeSGLang, FakeVLLM

from trace_proxy.demo.simulated_vllm import (
    JSON,
    Engine,
    Flight,
    SampleParams,
    TextModel,
    tool_rounds,
)

GENERATION_PROMPT = (151644, 77091, 198)  # "<|im_start|>assistant\n"
MAX_TOOL_ROUNDS = 4  # 1-5 turns
CONTINUE_CHANCE = (0.85, 0.6, 0.5, 0.45)  # calling tools again after `done` rounds
PARALLEL_WEIGHTS = ((1, 6), (2, 3), (3, 2))  # how many calls one turn makes
LEADS = (
    "Let me look this up.",
    "I need more information first.",
    "I will check a few sources.",
    "Two lookups should settle this.",
    "Checking the facts before answering.",
)
WORDS = (
    "alpha", "bravo", "delta", "ember", "fjord", "gamma", "harbor", "island", "jungle",
    "kernel", "lumen", "meadow", "nectar", "orbit", "prism", "quartz", "raven", "summit",
    "tundra", "umber", "vertex", "willow", "xenon", "yonder", "zephyr",
)  # fmt: skip
CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Bern", "Accra")


def split_generation(prompt_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt up to the last generation prompt, tokens the assistant already wrote after it).

    A resumed generate sends prompt + partial output; the head is what the original asked.
    """
    ids = tuple(prompt_ids)
    size = len(GENERATION_PROMPT)
    for end in range(len(ids), size - 1, -1):
        if ids[end - size : end] == GENERATION_PROMPT:
            return ids[:end], ids[end:]
    return ids, ()


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _arguments(name: str, topic: str, rng: random.Random) -> JSON:
    """Arguments with enough entropy that two rollouts rarely ask the very same thing."""
    if name == "search":
        return {"query": f"{topic} {_words(rng, 2)}", "top_k": rng.randint(1, 9)}
    if name == "get_weather":
        return {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
    if name == "python":
        n = rng.randint(2, 99)
        return {
            "code": f'values = [i * {n} for i in range(4)]\nprint("sum", sum(values) / {n % 7})'
        }
    if name == "calculator":
        return {
            "expression": f"{rng.randint(10, 999)} * {rng.randint(2, 99)} - {rng.randint(0, 9)}"
        }
    return {"entity": f"{topic.split()[-1]}-{rng.randint(1, 999)}", "fields": ["summary", "date"]}


class ScriptedText(TextModel):
    """The fakes' text model with an RL agent's behaviour (see the module docstring)."""

    def seed_for(self, prompt_ids: Sequence[int], index: int, params: SampleParams) -> int:
        """Seeded by the prompt before any partial output, so a resumed generate continues
        the very answer it was interrupted in."""
        head, _ = split_generation(prompt_ids)
        return super().seed_for(head, index, params)

    def _plan(self, prompt_ids: tuple[int, ...], seed: int) -> str:
        head, partial = split_generation(prompt_ids)
        if partial:
            whole: str = self.plan(head, seed)
            written = self.decode(partial)
            if whole.startswith(written):
                return whole[len(written) :]
        return super()._plan(prompt_ids, seed)

    def plan_chat(
        self, messages: Sequence[JSON], tools: Sequence[JSON], tool_choice: Any, seed: int
    ) -> str:
        rng = random.Random(seed)
        names = [str((t.get("function") or t).get("name")) for t in tools if isinstance(t, dict)]
        done = tool_rounds(messages)
        topic = _topic(messages)
        wants = done < MAX_TOOL_ROUNDS and rng.random() < CONTINUE_CHANCE[min(done, 3)]
        if names and tool_choice != "none" and wants:
            counts, weights = zip(*PARALLEL_WEIGHTS, strict=True)
            count = rng.choices(counts, weights)[0]
            blocks = []
            for _ in range(count):
                name = rng.choice(names)
                call = {"name": name, "arguments": _arguments(name, topic, rng)}
                blocks.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
            lead = f"{rng.choice(LEADS)} ({_words(rng, 2)})\n" if rng.random() < 0.5 else ""
            return lead + "\n".join(blocks)
        return (
            f"After {done} lookups about {topic}: {_words(rng, 4)}. Answer {rng.randint(1, 10**6)}."
        )


def _topic(messages: Sequence[JSON]) -> str:
    user: JSON = next((m for m in messages if m.get("role") == "user"), {})
    content = user.get("content")
    text = content if isinstance(content, str) else ""
    words = [w.strip(".,:;?!") for w in text.split() if w.isascii()]
    return " ".join(w for w in words[-3:] if w) or "the task"


class GatedEngine(Engine):
    """An engine that stalls chosen requests after `tokens` tokens until they are aborted.

    A test marks a request by a substring of its id before sending it (`gate`), then waits
    for the stall (`stalled`), then aborts it through the proxy: the abort always lands
    mid-generation, at a known token, whatever the machine's speed.
    """

    def __init__(self) -> None:
        super().__init__(0.0)
        self._gates: dict[str, int] = {}
        self._limits: dict[Flight, tuple[str, int]] = {}
        self._reached: dict[str, asyncio.Future[bool]] = {}

    def gate(self, marker: str, tokens: int) -> None:
        self._gates[marker] = tokens
        self._reached[marker] = asyncio.get_running_loop().create_future()

    def drop(self, marker: str) -> None:
        """Forget a gate whose request was never sent (its turn never came)."""
        self._gates.pop(marker, None)
        self._settle(marker, False)

    async def stalled(self, marker: str) -> bool:
        """True once the marked request stalls; False if it finished before its gate."""
        return await self._reached[marker]

    def admit(self, ids: Iterable[str]) -> Flight:
        ids = tuple(ids)
        flight = super().admit(ids)
        for marker in [m for m in self._gates if any(m in i for i in ids)]:
            self._limits[flight] = (marker, self._gates.pop(marker))
        return flight

    def release(self, flight: Flight) -> None:
        gate = self._limits.pop(flight, None)
        if gate is not None:
            self._settle(gate[0], False)
        super().release(flight)

    async def tick(self, flight: Flight) -> bool:
        gate = self._limits.get(flight)
        if gate is not None and flight.steps >= gate[1]:
            self._settle(gate[0], True)
            while not flight.aborted:
                await self._wake.wait()
            return False
        return await super().tick(flight)

    async def run(self, flight: Flight, steps: int) -> int:
        if flight not in self._limits:
            return await super().run(flight, steps)
        done = 0
        while done < steps and await self.tick(flight):
            done += 1
        return done

    def _settle(self, marker: str, stalled: bool) -> None:
        future = self._reached.get(marker)
        if future is not None and not future.done():
            future.set_result(stalled)


def scripted(fake: FakeVLLM | FakeSGLang, tokenizer: Any) -> GatedEngine:
    """Give a fake the scripted model and a gated engine; returns the engine."""
    fake.text = ScriptedText(tokenizer, fake.text.max_model_len)
    engine = GatedEngine()
    fake.engine = engine
    return engine


def build_fakes(tokenizer: Any) -> tuple[FakeVLLM, FakeSGLang, GatedEngine, GatedEngine]:
    """A vLLM and an SGLang fake (random ids, as real servers mint them) with the script."""
    vllm = FakeVLLM(tokenizer, model="tiny-qwen")
    sglang = FakeSGLang(tokenizer, model="tiny-qwen")
    return vllm, sglang, scripted(vllm, tokenizer), scripted(sglang, tokenizer)
