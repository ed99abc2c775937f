"""The canned RL workload: multi-turn vLLM `/v1/completions` calls with 1k- to 32k-token prompts.

Both the upstream and the load generator build the same bytes from the same seed, so the
upstream answers with pre-serialised bytes (a dict lookup, no JSON work on the hot path) and
the load generator can check every response it gets, through any proxy, byte for byte.

Turn k+1's prompt is turn k's prompt + its 16 output tokens + 32 new "tool result" tokens, as
in an agentic rollout, so trace-proxy's prompt-prefix sharing is exercised as it is in RL.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

import orjson

PATH = "/v1/completions"
# The same API on a path trace-proxy does not record: it forwards it untapped, which isolates
# the cost of forwarding from the cost of recording.
UNRECORDED_PATH = "/bench/unrecorded/v1/completions"
MODEL = "bench-model"
CREATED = 1763800000
PROMPT_TOKENS = 1024
PROMPT_SIZES = {"": 1024, "8k": 8192, "32k": 32768}  # mode suffix -> first prompt's ids
OUTPUT_TOKENS = 16
TOOL_TOKENS = 32
STREAM_CHUNKS = 4
VOCAB = 151_000
JSON_TYPE = "application/json"
SSE_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"
# The load generator asks the upstream to take this long (µs) before answering; the upstream
# answers how long it did wait, so the time a proxy adds is measured exactly, call by call.
DELAY_HEADER = "X-Bench-Delay-Us"
WAITED_HEADER = "X-Bench-Waited-Us"
LATENCY_SIGMA = 0.5  # of the lognormal generation time: p90 = 1.9x and p99 = 3.2x the median


@dataclass(frozen=True)
class Turn:
    """One call of a trajectory: the request body and the exact response the upstream sends."""

    request: bytes
    content_type: str
    chunks: tuple[bytes, ...]  # one element for JSON, several SSE events for a stream

    @property
    def response(self) -> bytes:
        return b"".join(self.chunks)


@dataclass(frozen=True)
class Mode:
    """A benchmark mode as written on the command line: `json`, `sse`, a prompt size
    (`json-8k`, `sse-32k`), an upstream that takes time to answer (`json-500ms`: each call's
    generation time drawn from a lognormal distribution with that median; for `sse`, the time
    to the first event) and, for an open loop, a fixed request rate (`json@500/s`).
    `-fixed`: every call's generation time is the latency itself (no spread); `-shared`: the
    cell runs unpinned, the system under test sharing every core with the client and the server,
    as a sidecar without a core of its own does (`json-100ms-fixed-shared`: a rollout's shape)."""

    name: str
    stream: bool
    prompt_tokens: int
    rate: float | None  # requests per second; None: closed loop
    latency_ms: float | None = None  # median time the upstream takes; None: it answers at once
    fixed: bool = False  # the upstream takes exactly `latency_ms`
    shared: bool = False  # not pinned, whatever --pin says


def parse_mode(name: str) -> Mode:
    base, _, rate = name.partition("@")
    kind, *suffixes = base.split("-")
    size, latency = "", ""
    flags: set[str] = set()
    for suffix in suffixes:
        if suffix in PROMPT_SIZES and not size:
            size = suffix
        elif suffix in ("fixed", "shared") and suffix not in flags:
            flags.add(suffix)
        elif suffix.endswith("s") and not latency:
            latency = suffix
        else:
            kind = ""  # not a mode
    if kind not in ("json", "sse") or ("fixed" in flags and not latency):
        sizes = ", ".join(f"-{s}" for s in PROMPT_SIZES if s)
        raise ValueError(
            f"unknown mode {name!r}: json or sse, optionally {sizes}, -LATENCY (-500ms) with "
            "-fixed, -shared, @RATE/s"
        )
    per_second = None
    if rate:
        try:
            per_second = float(rate.removesuffix("/s"))
        except ValueError:
            raise ValueError(f"mode {name!r}: the rate must read like @500/s") from None
    median_ms = None
    if latency:
        try:
            median_ms = _milliseconds(latency)
        except ValueError:
            raise ValueError(f"mode {name!r}: the latency must read like -500ms or -2s") from None
    return Mode(
        name, kind == "sse", PROMPT_SIZES[size], per_second, median_ms,
        fixed="fixed" in flags, shared="shared" in flags,
    )  # fmt: skip


def _milliseconds(text: str) -> float:
    """`500ms` or `2s` (the caller has seen the trailing s) in milliseconds, > 0."""
    value = float(text[:-2]) if text.endswith("ms") else float(text[:-1]) * 1000
    if not value > 0:
        raise ValueError(text)
    return value


def generation_delay_us(
    median_ms: float, sigma: float, seed: int, trajectory: int, turn: int
) -> int:
    """How long the upstream takes for one call: lognormal around `median_ms`, the same for the
    same call (seed, trajectory, turn) whichever system it goes through, so every system is
    given the same work to wait on."""
    digest = hashlib.blake2b(f"{seed}:{trajectory}:{turn}".encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 0.5) / 2**64  # in (0, 1)
    return round(median_ms * 1000 * math.exp(sigma * NormalDist().inv_cdf(uniform)))


def build_turns(
    turns: int, stream: bool, seed: int = 1, prompt_tokens: int = PROMPT_TOKENS
) -> list[Turn]:
    """The `turns` calls of one trajectory, JSON or streamed, deterministic for a seed."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    result = []
    for index in range(turns):
        output = [rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)]
        logprobs = [-round(rng.random() * 3, 4) for _ in range(OUTPUT_TOKENS)]
        request = _request(prompt, stream)
        if stream:
            chunks = _sse_chunks(index, prompt, output, logprobs)
            result.append(Turn(request, SSE_TYPE, chunks))
        else:
            body = orjson.dumps(_completion(index, prompt, output, logprobs))
            result.append(Turn(request, JSON_TYPE, (body,)))
        prompt = prompt + output + [rng.randrange(VOCAB) for _ in range(TOOL_TOKENS)]
    return result


def rollout_headers(step: int, sample_index: int, done: bool, rollout: int = 0) -> dict[str, str]:
    """The metadata an RL framework sends so trace-proxy groups calls into trajectories."""
    headers = {
        "Content-Type": JSON_TYPE,
        "X-Rollout-Experiment": "overhead-bench",
        "X-Rollout-Step": str(step),
        "X-Rollout-Sample-Index": str(sample_index),
        "X-Rollout-N": str(rollout),
    }
    if done:
        headers["X-Rollout-Done"] = "true"
    return headers


def _request(prompt: list[int], stream: bool) -> bytes:
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 1.0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _token_text(token: int) -> str:
    return f" t{token}"


def _logprobs(tokens: list[int], logprobs: list[float], offset: int) -> dict[str, object]:
    texts = [_token_text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": logprobs,
        "tokens": texts,
        "top_logprobs": [{text: lp} for text, lp in zip(texts, logprobs, strict=True)],
    }


def _usage(prompt: list[int]) -> dict[str, object]:
    return {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + OUTPUT_TOKENS,
        "completion_tokens": OUTPUT_TOKENS,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _completion(
    index: int, prompt: list[int], output: list[int], logprobs: list[float]
) -> dict[str, object]:
    """A non-streaming vLLM 0.33 completion, field order and nulls as vLLM serialises them."""
    choice = {
        "index": 0,
        "text": "".join(_token_text(t) for t in output),
        "logprobs": _logprobs(output, logprobs, 0),
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": output,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt,
        "routed_experts": None,
        "weight_versions": None,
    }
    return {
        "id": f"cmpl-bench-{index}",
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": "vllm-0.33.0-bench",
        "usage": _usage(prompt),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _sse_chunks(
    index: int, prompt: list[int], output: list[int], logprobs: list[float]
) -> tuple[bytes, ...]:
    """A vLLM completion stream: a few token chunks, the usage chunk, then `[DONE]`."""
    head = {"id": f"cmpl-bench-{index}", "object": "text_completion", "created": CREATED}
    size = len(output) // STREAM_CHUNKS
    events = []
    offset = 0
    for start in range(0, len(output), size):
        tokens = output[start : start + size]
        last = start + size >= len(output)
        text = "".join(_token_text(t) for t in tokens)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": _logprobs(tokens, logprobs[start : start + size], offset),
            "finish_reason": "length" if last else None,
            "stop_reason": None,
            "prompt_token_ids": prompt if start == 0 else None,
            "token_ids": tokens,
            "weight_versions": None,
        }
        offset += len(text)
        chunk = {**head, "model": MODEL, "choices": [choice], "kv_transfer_params": None}
        events.append(chunk)
    usage = {k: v for k, v in _usage(prompt).items() if v is not None}
    events.append(
        {
            **head,
            "model": MODEL,
            "choices": [],
            "usage": usage,
            "system_fingerprint": "vllm-0.33.0-bench",
        }
    )
    return (*(b"data: " + orjson.dumps(e) + b"\n\n" for e in events), DONE)
