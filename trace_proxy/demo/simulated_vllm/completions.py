"""`/v1/completions`, following vLLM 0.33's `vllm/entrypoints/openai/completion`.

Prompts as text, token ids or lists of either, `n` choices per prompt, `CompletionLogProbs`,
and the `exclude_unset` streaming chunks with the usage-only final chunk.
"""

from __future__ import annotations

from aiohttp import web

from .base import Ctx, Seq, VLLMBase
from .chatml import ascii_text
from .engine import Flight, Paused
from .errors import VLLMError, generation_error, paused_error, spaced_error, validation_error
from .logprobs import completion_logprobs, prompt_logprobs
from .parsing import (
    check_int_field,
    check_prompt_logprobs,
    check_stream_options,
    read_body,
    usage_flags,
)
from .wire import JSON, dumps, json_response


class CompletionsRoutes(VLLMBase):
    """The completions route: one request's prompts sampled, answered whole or streamed."""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await read_body(request)
            prompts = self._completion_prompts(body)
            check_stream_options(body)
            check_prompt_logprobs(body)
            check_int_field(body, "logprobs")
            logprobs = body.get("logprobs")
            if logprobs is not None and logprobs < 0 and logprobs != -1:
                raise validation_error(
                    "`logprobs` must be a positive value or -1.", "logprobs", logprobs
                )
            n = int(body.get("n") or 1)
            max_tokens = body.get("max_tokens")
            seqs = []
            for p_idx, ids in enumerate(prompts):
                params = self._params(body, len(ids), 16 if max_tokens is None else max_tokens)
                for j in range(n):
                    seqs.append(Seq(p_idx * n + j, ids, self._sample(ids, j, params)))
            request_id = f"cmpl-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit(
                [request_id] + [f"{request_id}-{i}" for i in range(len(prompts))]
            )
        except VLLMError as exc:
            return exc.response()
        except Paused:
            return await self._refuse_paused(request, body, spaced_error(paused_error()))
        ctx = Ctx(request, raw, body, request_id, self.created(), n)
        return await self._respond(
            ctx,
            flight,
            lambda: self._completions_stream(ctx, flight, seqs),
            lambda: self._completions_full(ctx, flight, seqs),
        )

    def _completion_prompts(self, body: JSON) -> list[tuple[int, ...]]:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return [self.text.encode(prompt, add_special)]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [tuple(prompt)]
        if isinstance(prompt, list):
            out = []
            for item in prompt:
                if isinstance(item, str):
                    out.append(self.text.encode(item, add_special))
                elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                    out.append(tuple(item))
                else:
                    break
            else:
                return out
        raise VLLMError(
            "1 validation error:\n  {'type': 'union_tag_invalid', 'loc': 'body.prompt', "
            "'msg': 'Input should be a string, a list of strings, a list of token ids or a "
            f"list of token id lists', 'input': {ascii_text(prompt, 200)!r}}}",
            "Bad Request",
            400,
            "body.prompt",
        )

    async def _completions_full(
        self, ctx: Ctx, flight: Flight, seqs: list[Seq]
    ) -> web.StreamResponse:
        await self._final(flight, seqs)
        body = ctx.body
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        logprobs = body.get("logprobs")
        token_ids = bool(body.get("return_token_ids"))
        prompt_count = body.get("prompt_logprobs")
        choices: list[JSON] = []
        for seq in seqs:
            s = seq.sample
            lp = None
            if logprobs is not None:
                lp, _ = completion_logprobs(self.text, s, 0, len(s.token_ids), logprobs, as_ids, 0)
            choices.append(
                {
                    "index": len(choices),
                    "text": s.text,
                    "logprobs": lp,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": list(s.token_ids) if token_ids else None,
                    "prompt_logprobs": (
                        prompt_logprobs(self.text, seq.prompt_ids, prompt_count)
                        if prompt_count is not None
                        else None
                    ),
                    "prompt_token_ids": list(seq.prompt_ids) if token_ids else None,
                    "routed_experts": None,
                    "weight_versions": self._asked_versions(body, flight, len(s.token_ids)),
                }
            )
        prompt_tokens = sum(len(seq.prompt_ids) for seq in seqs if seq.index % ctx.n == 0)
        completion_tokens = sum(len(seq.sample.token_ids) for seq in seqs)
        return json_response(
            {
                "id": ctx.request_id,
                "object": "text_completion",
                "created": ctx.created,
                "model": self.model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(prompt_tokens, completion_tokens),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    async def _completions_stream(
        self, ctx: Ctx, flight: Flight, seqs: list[Seq]
    ) -> web.StreamResponse:
        body = ctx.body
        usage, continuous = usage_flags(body)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        logprobs = body.get("logprobs")
        token_ids = bool(body.get("return_token_ids"))
        versions = bool(body.get("return_weight_versions"))
        sse = self._stream(ctx.request, spaced_error(generation_error()))
        await sse.open()
        offsets = {seq.index: 0 for seq in seqs}

        def token(seq: Seq, step: int, finished: bool) -> bytes:
            s = seq.sample
            lp = None
            if logprobs is not None:
                lp, offsets[seq.index] = completion_logprobs(
                    self.text, s, step, step + 1, logprobs, as_ids, offsets[seq.index]
                )
            chunk = self._completion_chunk(
                ctx,
                seq,
                text=s.deltas[step],
                logprobs=lp,
                finish=s.finish_reason if finished else None,
                stop_reason=s.stop_reason if finished else None,
                token_ids=[s.token_ids[step]] if token_ids else None,
                first=step == 0 and token_ids,
                versions=flight.weight_versions(step + 1) if versions and finished else None,
                fingerprint=finished and not usage,
                usage=self._short_usage(len(seq.prompt_ids), step + 1) if continuous else None,
            )
            return dumps(chunk)

        def closing(seq: Seq, emitted: int) -> bytes:
            chunk = self._completion_chunk(
                ctx,
                seq,
                text="",
                logprobs=None,
                finish="abort",
                stop_reason=None,
                token_ids=[] if token_ids else None,
                first=emitted == 0 and token_ids,
                versions=None,
                fingerprint=not usage,
                usage=None,
            )
            return dumps(chunk)

        def tail(completion: int) -> bytes:
            prompt_tokens = sum(len(seq.prompt_ids) for seq in seqs if seq.index % ctx.n == 0)
            return dumps(
                {
                    "id": ctx.request_id,
                    "object": "text_completion",
                    "created": ctx.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self._short_usage(prompt_tokens, completion),
                    "system_fingerprint": self.system_fingerprint,
                }
            )

        return await self._emit(sse, flight, seqs, token, closing, tail if usage else None)

    def _completion_chunk(
        self,
        ctx: Ctx,
        seq: Seq,
        *,
        text: str,
        logprobs: JSON | None,
        finish: str | None,
        stop_reason: int | str | None,
        token_ids: list[int] | None,
        first: bool,
        versions: list[JSON] | None,
        fingerprint: bool,
        usage: JSON | None,
    ) -> JSON:
        chunk: JSON = {
            "id": ctx.request_id,
            "object": "text_completion",
            "created": ctx.created,
            "model": self.model,
            "choices": [
                {
                    "index": seq.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "prompt_token_ids": list(seq.prompt_ids) if first else None,
                    "token_ids": token_ids,
                    "weight_versions": versions,
                }
            ],
        }
        return self._chunk_end(chunk, usage, fingerprint and finish is not None)
