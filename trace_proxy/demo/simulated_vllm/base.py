"""What every vLLM route family shares: request ids, sampling, pacing, errors as responses.

The chat, completions and token-in generate routes differ in their bodies, not in how a request
is admitted, paced, aborted or refused; that part lives here once, for all three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .engine import Flight
from .errors import VLLMError, generation_error, paused_error
from .model import Sample, SampleParams
from .server import SimulatedServer
from .sse import SSEStream, error_stream
from .wire import JSON

VLLM_VERSION = "0.33.0"


@dataclass
class Seq:
    """One output sequence of a request: its choice index, prompt and planned sample."""

    index: int
    prompt_ids: tuple[int, ...]
    sample: Sample


@dataclass
class Ctx:
    """Per-request values the response builders need."""

    request: web.Request
    raw: bytes
    body: JSON
    request_id: str
    created: int
    n: int  # choices per prompt


class VLLMBase(SimulatedServer):
    """The simulated vLLM's shared request handling; the route families build on it."""

    tool_call_parser: str | None
    api_key: str | None
    system_fingerprint: str

    def _request_base_id(self, request: web.Request, body: JSON, raw: bytes) -> str:
        header = request.headers.get("X-Request-Id")
        if header is not None:
            return header
        if isinstance(body.get("request_id"), str):
            return str(body["request_id"])
        return self.new_id(raw, request.path)

    def _params(
        self, body: JSON, prompt_len: int, max_tokens: int | None, skip_special: bool = True
    ) -> SampleParams:
        limit = self.text.max_model_len - prompt_len
        if limit < 0:
            raise VLLMError(
                f"Input length ({prompt_len}) exceeds model's maximum context length "
                f"({self.text.max_model_len}).",
                "BadRequestError",
                400,
            )
        stop = body.get("stop") or []
        skip = body.get("skip_special_tokens")
        return SampleParams(
            max_tokens=min(max_tokens, limit) if max_tokens is not None else limit,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            skip_special_tokens=skip_special if skip is None else bool(skip),
            seed=body.get("seed"),
            greedy=body.get("temperature") == 0,
        )

    def _sample(self, prompt_ids: tuple[int, ...], index: int, params: SampleParams) -> Sample:
        seed = self.text.seed_for(prompt_ids, index, params)
        return self.text.sample(self.text.plan(prompt_ids, seed), params, seed)

    def _render(self, body: JSON, messages: Any, tools: Any) -> tuple[int, ...]:
        """Chat prompt ids; a template failure is a 400, as vLLM maps jinja errors."""
        try:
            _, ids = self.text.render_chat(
                messages,
                tools,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=bool(body.get("continue_final_message")),
                template_kwargs=body.get("chat_template_kwargs"),
            )
        except Exception as exc:
            raise VLLMError(str(exc), "BadRequestError", 400) from exc
        return ids

    @staticmethod
    def _short_usage(prompt_tokens: int, completion_tokens: int) -> JSON:
        """`UsageInfo` as streams send it: unset details are left out (`exclude_unset`)."""
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    @classmethod
    def _usage(cls, prompt_tokens: int, completion_tokens: int) -> JSON:
        """`UsageInfo` in a whole response: the details as nulls."""
        usage = cls._short_usage(prompt_tokens, completion_tokens)
        return {**usage, "prompt_tokens_details": None, "completion_tokens_details": None}

    def _chunk_end(self, chunk: JSON, usage: JSON | None, fingerprint: bool) -> JSON:
        """A stream chunk's fields after its choices: usage, the fingerprint, kv params."""
        if usage is not None:
            chunk["usage"] = usage
        if fingerprint:
            chunk["system_fingerprint"] = self.system_fingerprint
        chunk["kv_transfer_params"] = None
        return chunk

    @staticmethod
    def _asked_versions(body: JSON, flight: Flight, count: int) -> list[JSON] | None:
        """A whole answer's weight-version spans, when `return_weight_versions` asks for them."""
        return flight.weight_versions(count) if body.get("return_weight_versions") else None

    def _stream(self, request: web.Request, error_event: bytes) -> SSEStream:
        return SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=error_event,
        )

    @staticmethod
    async def _refuse_paused(request: web.Request, body: JSON, event: bytes) -> web.StreamResponse:
        """A request refused while paused: `event` as its stream if it asked for one, else 503."""
        if body.get("stream"):
            return await error_stream(request, event)
        return paused_error().response()

    async def _respond(
        self,
        ctx: Ctx,
        flight: Flight,
        stream: Callable[[], Any],
        whole: Callable[[], Any],
    ) -> web.StreamResponse:
        """Stream or answer whole, as the body asks; a VLLMError raised meanwhile is the answer."""
        run = stream if ctx.body.get("stream") else whole
        try:
            response: web.StreamResponse = await self.track(flight, [ctx.request_id], run)
        except VLLMError as exc:
            return exc.response()
        return response

    async def _emit(
        self,
        sse: SSEStream,
        flight: Flight,
        seqs: list[Seq],
        token: Callable[[Seq, int, bool], bytes | None],
        closing: Callable[[Seq, int], bytes],
        tail: Callable[[int], bytes] | None,
        opening: Sequence[bytes] = (),
    ) -> web.StreamResponse:
        """Pace a stream: an event per token step and choice, then the cut choices, then the end.

        `token(seq, step, finished)` is a token's event (None: nothing to send), `closing(seq,
        emitted)` the `abort` finish of a choice an abort cut short, `tail(completion_tokens)`
        the usage-only chunk (None when not asked for), `opening` what goes before the first
        token.
        """
        emitted = {seq.index: 0 for seq in seqs}
        longest = max(len(seq.sample.token_ids) for seq in seqs)
        started = False
        async for step in self.steps(flight, longest):
            if not started:
                started = True
                for event in opening:
                    if not await sse.send(event):
                        return await sse.finish()
            for seq in seqs:
                if step >= len(seq.sample.token_ids):
                    continue
                emitted[seq.index] = step + 1
                out = token(seq, step, step == len(seq.sample.token_ids) - 1)
                if out is not None and not await sse.send(out):
                    return await sse.finish()
        for seq in seqs:  # aborted: close unfinished choices
            if emitted[seq.index] < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(emitted[seq.index])
                if not await sse.send(closing(seq, emitted[seq.index])):
                    return await sse.finish()
        if tail is not None:
            await sse.send(tail(sum(len(seq.sample.token_ids) for seq in seqs)))
        return await sse.finish()

    async def _final(self, flight: Flight, seqs: list[Seq]) -> None:
        """Pace a non-streaming request; samples are cut short if it was aborted."""
        longest = max(len(s.sample.token_ids) for s in seqs)
        steps = await self.engine.run(flight, longest)
        for seq in seqs:
            if steps < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(steps)
        if self.error_after_chunks is not None:
            raise generation_error()
