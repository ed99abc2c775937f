"""token2text throughput: trace-proxy's Token2Text against a bare `tokenizers` decode.

    python benchmarks/decode.py [--trajectories 300] [--rounds 5] [--seed 0]

token2text decodes every kept trajectory once, in the export pipeline's thread. This measures
what that costs per token compared with the floor: the Rust tokenizer's own `decode` of the
very same id sequences. The workload is realistic closed trajectories of an agentic RL run
(Qwen chat template with tools, a long user context, 1-5 turns of reasoning + Hermes tool
calls, 1-3 parallel calls per turn, tool results of various sizes), assembled by trace-proxy's
own Assembler (so prompts are prefix-shared as in the store). One warm-up pass records which
sequences Token2Text decodes (stored prompt suffixes, outputs, the transcript, the tool-result
slices); then, in each round, both paths run on the same ids, in alternating order, and the
median of the rounds is reported. Token2Text runs twice: as the proxy runs it (decoding and
the retokenization drift checks, text/drift.py) and with decoding alone (a tokenizer
added without its codec), so the drift checks' share is measured. Prints a markdown table;
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer, load_qwen_tokenizer
from trace_proxy.text.token2text import Token2Text, Tokenizers, load_configured
from trace_proxy.text.toolparsers import get_parser
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.record import GenerateCall, Output, Prompt, Record, Trajectory

IM_END = 151645
WORDS = (
    "the", "policy", "reward", "gradient", "value", "token", "sample", "result", "search",
    "harbor", "prism", "orbit", "summit", "kernel", "vertex", "3.14", "2048", "(see", "above)",
    "therefore", "however,", "Zürich", "naïve", "data:", "x_1", "->", "=", "{id:", "7}",
)  # fmt: skip
TOOL_NAMES = ("search", "python", "get_weather", "lookup")
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for name in TOOL_NAMES
]  # fmt: skip


@dataclass(frozen=True)
class CallSpec:
    """One generate call of the workload: full prompt ids and output ids."""

    trajectory: int
    start: float
    prompt: list[int]
    output: list[int]


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def response_text(rng: random.Random, last: bool) -> str:
    """Reasoning, then tool calls (Hermes) or a final answer."""
    thinking = f"<think>\n{words(rng, 40, 500)}\n</think>\n\n"
    if last:
        return thinking + f"The answer is {words(rng, 10, 80)}."
    calls = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        call = {"name": rng.choice(TOOL_NAMES), "arguments": {"query": words(rng, 2, 12)}}
        calls.append(f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>")
    return thinking + "\n".join(calls)


def tool_turn(rng: random.Random, count: int) -> str:
    """The ChatML tool turn after a response that ended with <|im_end|>."""
    blocks = "".join(
        f"\n<tool_response>\n{words(rng, 10, 400)}\n</tool_response>" for _ in range(count)
    )
    return f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n"


def workload(count: int, seed: int, hf: Any, tok: Tokenizer) -> list[CallSpec]:
    """The calls of `count` agent trajectories, in the order a proxy would see them."""
    rng = random.Random(seed)
    specs: list[CallSpec] = []
    for t in range(count):
        messages = [
            {"role": "system", "content": "You are a research agent."},
            {"role": "user", "content": f"Context: {words(rng, 150, 1500)}\nQuestion {t}?"},
        ]
        text = hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        prompt = tok.encode(str(text), add_special_tokens=False).ids
        turns = rng.randint(1, 5)
        for turn in range(turns):
            reply = response_text(rng, turn == turns - 1)
            output = [*tok.encode(reply, add_special_tokens=False).ids, IM_END]
            specs.append(CallSpec(t, t + turn * 0.001, prompt, output))
            calls = reply.count("<tool_call>")
            prompt = [
                *prompt,
                *output,
                *tok.encode(tool_turn(rng, calls), add_special_tokens=False).ids,
            ]
    return specs


def assemble(specs: Sequence[CallSpec]) -> list[Trajectory]:
    """Closed trajectories, as trace-proxy's Assembler builds them (prefix sharing included)."""
    out: list[Record] = []
    assembler = Assembler(out.append, project="bench", experiment="decode", idle_timeout=3600)
    for spec in specs:
        hints = KeyHints()
        hints.offer("trajectory_id", f"t{spec.trajectory}", "bench")
        call = GenerateCall(
            index=-1, dialect="sglang.generate", route="/generate", upstream="bench",
            start=spec.start, end=spec.start + 0.0005, model="tiny-qwen",
            prompt=Prompt(token_ids=list(spec.prompt)),
            outputs=[Output(index=0, token_ids=list(spec.output), finish_reason="stop")],
        )  # fmt: skip
        assembler.add_call(hints, call)
    assembler.close_all()
    return [r for r in out if isinstance(r, Trajectory)]


def decoded_sequences(specs: Sequence[CallSpec], tokenizer_dir: str) -> list[list[int]]:
    """Every id sequence Token2Text decodes for this workload (recorded in a warm-up pass)."""
    seen: list[list[int]] = []
    decode = load_configured([tokenizer_dir], skip_special_tokens=False).for_model(None)
    assert decode is not None

    def recording(ids: Sequence[int]) -> str:
        seen.append(list(ids))
        return decode(ids)

    tokenizers = Tokenizers()
    tokenizers.add(None, recording)
    Token2Text(tokenizers, get_parser("hermes")).process(list(assemble(specs)))
    return seen


def time_bare(tok: Tokenizer, sequences: Sequence[list[int]]) -> float:
    start = time.perf_counter()
    for ids in sequences:
        tok.decode(ids, skip_special_tokens=False)
    return time.perf_counter() - start


def time_token2text(processor: Token2Text, specs: Sequence[CallSpec]) -> tuple[float, int]:
    trajectories = assemble(specs)  # fresh records each round; not timed
    start = time.perf_counter()
    processor.process(list(trajectories))
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(t.tools) for t in trajectories)


def median_rounds(
    rounds: int,
    bare: Callable[[], float],
    t2t: Callable[[], tuple[float, int]],
    decode_only: Callable[[], tuple[float, int]],
) -> tuple[float, float, float, int]:
    """Median seconds of each path; each round runs them in another order (rotated)."""
    paths: list[Callable[[], tuple[float, int]]] = [lambda: (bare(), 0), t2t, decode_only]
    times: list[list[float]] = [[], [], []]
    spans = 0
    for i in range(rounds):
        for k in range(3):
            which = (i + k) % 3
            elapsed, found = paths[which]()
            times[which].append(elapsed)
            spans = max(spans, found)
    bare_s, t2t_s, decode_s = (statistics.median(t) for t in times)
    return bare_s, t2t_s, decode_s, spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer_dir = str(ensure_qwen_tokenizer())
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    specs = workload(args.trajectories, args.seed, load_qwen_tokenizer(), tok)
    sequences = decoded_sequences(specs, tokenizer_dir)
    tokens = sum(map(len, sequences))
    configured = load_configured([tokenizer_dir], False)
    processor = Token2Text(configured, get_parser("hermes"))
    without_codec = Tokenizers()
    decode = configured.for_model(None)
    assert decode is not None and configured.codec_for_model(None) is not None
    without_codec.add(None, decode)  # no codec: no drift checks
    decoding_only = Token2Text(without_codec, get_parser("hermes"))
    bare, t2t, decode_only, spans = median_rounds(
        args.rounds,
        lambda: time_bare(tok, sequences),
        lambda: time_token2text(processor, specs),
        lambda: time_token2text(decoding_only, specs),
    )
    report(args, specs, sequences, tokens, bare, t2t, decode_only, spans)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.machine()


def report(
    args: argparse.Namespace,
    specs: Sequence[CallSpec],
    sequences: Sequence[list[int]],
    tokens: int,
    bare: float,
    t2t: float,
    decode_only: float,
    spans: int,
) -> None:
    n = args.trajectories
    final = {s.trajectory: len(s.prompt) + len(s.output) for s in specs}
    context = sum(final.values())
    command = "python benchmarks/decode.py " + shlex.join(sys.argv[1:])
    print(f"## token2text decode throughput\n\nCommand: `{command.strip()}`\n")
    print(
        f"Workload: {n} trajectories, {len(specs)} calls ({len(specs) / n:.1f} turns each), "
        f"final context {context / n:.0f} tokens on average (max {max(final.values())}), "
        f"{spans} tool spans parsed. Token2Text decodes {len(sequences)} id sequences, "
        f"{tokens} tokens per pass ({tokens / context:.2f}x the trajectories' {context} tokens: "
        f"stored prompt suffixes, outputs, tool-result slices and the whole transcript); the "
        f"bare decode gets the same sequences. Median of {args.rounds} rounds.\n"
    )
    print("| path | seconds | decoded tokens/s | trajectory tokens/s | trajectories/s | time |")
    print("|---|---|---|---|---|---|")
    for name, seconds in (
        ("bare `tokenizers` decode", bare),
        ("`Token2Text.process`, decoding only", decode_only),
        ("`Token2Text.process` with drift checks (as run)", t2t),
    ):
        print(
            f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {context / seconds:,.0f} "
            f"| {n / seconds:,.0f} | {seconds / bare:.2f}x |"
        )
    per_call = (t2t - decode_only) / len(specs) * 1e6
    print(
        f"\nDrift checks: {t2t - decode_only:+.3f} s per pass, {per_call:+.0f} µs per call, "
        f"{(t2t - decode_only) / decode_only:+.0%} of decoding alone."
    )
    print(
        f"\nMachine: {os.cpu_count()} cores ({cpu_model()}), Python {platform.python_version()}, "
        f"tokenizers {version('tokenizers')}, transformers {version('transformers')}, "
        f"trace-proxy {version('trace-proxy')}."
    )


if __name__ == "__main__":
    main()
