"""Agent loops, one rollout each, writing down the truth as they go.

Chat agents keep a message list (assistant turn with `tool_calls`, then one `role: tool`
message per call). Token agents keep token ids, as verl's and slime's loops do: turn N+1's
prompt is turn N's prompt + response ids + the tokenized tool turn. A token generate that comes
back aborted is re-POSTed with prompt + the ids so far (AReaL), after the trainer reopened
generation if it was a pause.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from groundtruth import clients
from groundtruth.clients import JSON, Reply, Sampling
from groundtruth.model import GatedEngine
from groundtruth.tooling import (
    TOOLS,
    ToolRequest,
    canonical,
    execute,
    parse_tool_calls,
    tool_results_suffix,
)
from groundtruth.truth import TrueCall, TrueTool, TrueTrajectory

MAX_TURNS = 6
MAX_TOKENS = 1024
IM_END_ID = 151645
IM_END_TEXT = "<|im_end|>"


@dataclass(frozen=True)
class Variant:
    """A dialect as one kind of agent speaks it."""

    name: str
    backend: str  # "vllm" | "sglang"
    api: str  # "chat" | "completions" | "vllm_generate" | "sglang_generate"
    stream: bool = False
    areal: bool = False  # AReaL's completions payload
    text: bool = False  # text back, re-tokenized by the agent (skyrl-train's remote engine)
    batched: bool = False  # first turns go out as one batch of prompts (a list of id lists)

    @property
    def tokens(self) -> bool:
        return self.api != "chat"


@dataclass(frozen=True)
class Interrupt:
    """Stall turn `turn` after `tokens` tokens, then abort it by a pause at the weight update
    (`kind="update"`) or at once through the abort route (`kind="abort"`)."""

    turn: int
    tokens: int
    kind: str
    marker: str = field(default_factory=lambda: f"gt{uuid.uuid4().hex}")


@dataclass
class Batch:
    """First turns of `size` rollouts sent as one request, as skyrl-train batches them; each
    rollout gets its own choice. A batch carries one seed, so its rollouts are of different
    samples (rollout r of each): a group's rollouts differ by their batch's seed."""

    size: int
    seed: int | None
    waiting: list[tuple[list[int], asyncio.Future[Reply]]] = field(default_factory=list)

    async def generate(self, backend: Backend, rollout: Rollout, ids: list[int]) -> Reply:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, future))
        if len(self.waiting) == self.size:
            await self._send(backend, rollout)
        return await future

    async def _send(self, backend: Backend, rollout: Rollout) -> None:
        s = rollout.sampling
        body = clients.text_completions_body(
            [ids for ids, _ in self.waiting], Sampling(s.max_tokens, s.temperature, self.seed)
        )
        try:
            payload = await clients.post(
                backend.session, backend.url + "/v1/completions", body, rollout.headers
            )
            replies = clients.read_text_completions(payload)
        except Exception as exc:
            for _, future in self.waiting:
                future.set_exception(exc)
            return
        for (_, future), reply in zip(self.waiting, replies, strict=True):
            # One response id for the batch: each rollout's unit is the id and its reply.
            reply.request_id = f"{reply.request_id}#{reply.content}"
            future.set_result(reply)


@dataclass
class Rollout:
    """Everything one agent loop needs; it fills in `truth` as it goes."""

    truth: TrueTrajectory
    variant: Variant
    messages: list[JSON]
    sampling: Sampling
    headers: dict[str, str]
    prefix: str = ""  # a `/rollout/<field>=<value>/...` path prefix carrying the key
    interrupt: Interrupt | None = None
    batch: Batch | None = None  # its first turn's batch (batched variants)


@dataclass
class Backend:
    """One inference server behind its own proxy, and the trainer's switch for generation."""

    name: str
    url: str  # the proxy's
    session: aiohttp.ClientSession
    engine: GatedEngine
    tokenizer: Any
    generation_open: asyncio.Event = field(default_factory=asyncio.Event)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False))

    def first_prompt(self, messages: list[JSON]) -> list[int]:
        """The chat template with tools, tokenized once per sample."""
        key = repr(messages)
        if key not in self.prompts:
            text = self.tokenizer.apply_chat_template(
                messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
            self.prompts[key] = self.encode(str(text))
        return self.prompts[key]


async def run_rollout(backend: Backend, rollout: Rollout) -> None:
    """Run one rollout to its final answer; a gate it never reached is released."""
    try:
        if rollout.variant.tokens:
            await _token_loop(backend, rollout)
        else:
            await _chat_loop(backend, rollout)
    finally:
        if rollout.interrupt is not None:
            backend.engine.drop(rollout.interrupt.marker)  # a turn never reached


# --- chat ---------------------------------------------------------------------------------------


async def _chat_loop(backend: Backend, rollout: Rollout) -> None:
    truth, variant = rollout.truth, rollout.variant
    messages = list(rollout.messages)
    path = backend.url + rollout.prefix + "/v1/chat/completions"
    for turn in range(MAX_TURNS):
        body = clients.chat_body(variant.backend, messages, TOOLS, rollout.sampling, variant.stream)
        payload = await clients.post(backend.session, path, body, rollout.headers)
        reply = clients.read_chat(payload, variant.stream)
        truth.calls.append(TrueCall([reply.request_id], None, reply.finish_reason))
        if turn == 0:
            truth.first_reply = repr((reply.content, [c["function"] for c in reply.tool_calls]))
        if not reply.tool_calls:
            return
        messages.append(
            {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
        )
        requests = [
            ToolRequest(c["function"]["name"], c["function"]["arguments"], c["id"])
            for c in reply.tool_calls
        ]
        for request, result in _run_tools(truth, turn, requests):
            messages.append({"role": "tool", "tool_call_id": request.call_id, "content": result})


def _run_tools(
    truth: TrueTrajectory, turn: int, requests: list[ToolRequest]
) -> list[tuple[ToolRequest, str]]:
    done = []
    for request in requests:
        result = execute(request.name, request.arguments)
        error = result.startswith("Error when executing tool")
        truth.tools.append(
            TrueTool(request.name, canonical(request.arguments), result, turn, len(requests), error)
        )
        done.append((request, result))
    return done


# --- tokens -------------------------------------------------------------------------------------


async def _token_loop(backend: Backend, rollout: Rollout) -> None:
    truth = rollout.truth
    ids = list(backend.first_prompt(rollout.messages))
    if rollout.variant.text:
        await _text_loop(backend, rollout, ids)
        return
    for turn in range(MAX_TURNS):
        call = await _logical_generate(backend, rollout, ids, turn)
        truth.calls.append(call)
        output = call.output_ids or []
        text = backend.decode(output)
        if turn == 0:
            truth.first_reply = text
        requests = parse_tool_calls(text)
        if not requests or call.finish_reason != "stop":
            return
        results = [result for _, result in _run_tools(truth, turn, requests)]
        ended = bool(output) and output[-1] == IM_END_ID
        ids = [*ids, *output, *backend.encode(tool_results_suffix(results, ended))]


async def _text_loop(backend: Backend, rollout: Rollout, ids: list[int]) -> None:
    """skyrl-train's loop: the reply comes as text and is tokenized again for the next turn,
    so the next prompt need not hold the ids the server generated."""
    truth = rollout.truth
    for turn in range(MAX_TURNS):
        if turn == 0 and rollout.batch is not None:
            reply = await rollout.batch.generate(backend, rollout, ids)
        else:
            body = clients.text_completions_body([ids], rollout.sampling)
            body["prompt"] = ids  # one prompt: a plain id list
            url = backend.url + rollout.prefix + "/v1/completions"
            payload = await clients.post(backend.session, url, body, rollout.headers)
            [reply] = clients.read_text_completions(payload)
        text = reply.content or ""
        truth.calls.append(TrueCall([reply.request_id], None, reply.finish_reason))
        if turn == 0:
            truth.first_reply = text
        requests = parse_tool_calls(text)
        if not requests or reply.finish_reason != "stop":
            return
        results = [result for _, result in _run_tools(truth, turn, requests)]
        ended = text.endswith(IM_END_TEXT)
        ids = [*ids, *backend.encode(text), *backend.encode(tool_results_suffix(results, ended))]


async def _logical_generate(
    backend: Backend, rollout: Rollout, prompt: list[int], turn: int
) -> TrueCall:
    """One logical generate: resumed with prompt + partial output for as long as it is aborted."""
    request_ids: list[str] = []
    output: list[int] = []
    rid = _interrupted_rid(backend, rollout, turn)
    while True:
        s = rollout.sampling
        left = Sampling(s.max_tokens - len(output), s.temperature, s.seed)
        reply = await _send_tokens(backend, rollout, [*prompt, *output], left, rid)
        request_ids.append(reply.request_id)
        output.extend(reply.token_ids or [])
        if reply.finish_reason != "abort":
            return TrueCall(request_ids, output, reply.finish_reason)
        rid = None  # AReaL re-POSTs under a new id once generation is open again
        await backend.generation_open.wait()


def _interrupted_rid(backend: Backend, rollout: Rollout, turn: int) -> str | None:
    """The request id that marks this turn's generate for its interruption, if it has one;
    an abort-route interruption gets its controller started here."""
    interrupt = rollout.interrupt
    if interrupt is None or interrupt.turn != turn:
        return None
    if interrupt.kind == "abort":
        task = asyncio.create_task(_abort_when_stalled(backend, rollout.variant, interrupt.marker))
        backend.background.add(task)
        task.add_done_callback(backend.background.discard)
    return interrupt.marker


ROUTES = {
    "completions": "/v1/completions",
    "vllm_generate": "/inference/v1/generate",
    "sglang_generate": "/generate",
}


async def _send_tokens(
    backend: Backend, rollout: Rollout, ids: list[int], s: Sampling, rid: str | None
) -> Reply:
    variant = rollout.variant
    url = backend.url + rollout.prefix + ROUTES[variant.api]
    if variant.api == "completions":
        body = clients.completions_body(ids, s, variant.stream, variant.areal, rid)
    elif variant.api == "vllm_generate":
        body = clients.vllm_generate_body(ids, s, variant.stream, rid)
    else:
        body = clients.sglang_generate_body(ids, s, variant.stream, rid)
    payload = await clients.post(backend.session, url, body, rollout.headers)
    if variant.api == "completions":
        return clients.read_completions(payload, variant.stream, variant.areal)
    if variant.api == "vllm_generate":
        return clients.read_vllm_generate(payload, variant.stream)
    return clients.read_sglang_generate(payload, variant.stream)


async def _abort_when_stalled(backend: Backend, variant: Variant, marker: str) -> None:
    """Abort one request through the proxy's abort route, as a rollout controller would."""
    if not await backend.engine.stalled(marker):
        return
    body: JSON
    if variant.backend == "sglang":
        route, body = "/abort_request", {"rid": marker}
    else:
        prefix = "cmpl-" if variant.api == "completions" else "generate-tokens-"
        route, body = "/abort_requests", {"request_ids": [prefix + marker]}
    async with backend.session.post(backend.url + route, json=body) as response:
        await response.read()
