"""`/inference/v1/generate`, following vLLM 0.33's `scale_out/token_in_token_out`.

Token ids in, token ids (or text) out, the way RL trainers call vLLM: `GenerateLogProbs` with
integer ids, weight-version spans on every finished choice, and its streaming chunks.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .base import Ctx, Seq, VLLMBase
from .engine import Flight, Paused
from .errors import VLLMError, generation_error, not_an_object_error, paused_error, spaced_error
from .logprobs import chat_logprobs, generate_logprobs
from .parsing import check_stream_options, read_body, usage_flags
from .wire import JSON, dumps, json_response


class GenerateRoutes(VLLMBase):
    """The token-in, token-out generate route, answered whole or streamed."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await read_body(request, ("token_ids", "sampling_params"))
            prompt_ids = tuple(body["token_ids"])
            if not isinstance(body["sampling_params"], dict):
                raise not_an_object_error(
                    "sampling_params", body["sampling_params"], "SamplingParams"
                )
            sp = body["sampling_params"]
            check_stream_options(body)
            mode = body.get("output_mode", "tokens")
            if mode not in ("tokens", "text"):
                raise VLLMError(f"output_mode={mode!r} is not simulated", "BadRequestError", 400)
            params = self._params({**sp}, len(prompt_ids), sp.get("max_tokens"))
            seqs = [
                Seq(j, prompt_ids, self._sample(prompt_ids, j, params))
                for j in range(int(sp.get("n") or 1))
            ]
            request_id = f"generate-tokens-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit([request_id])
        except VLLMError as exc:
            return exc.response()
        except Paused:
            return await self._refuse_paused(request, body, spaced_error(paused_error()))
        ctx = Ctx(request, raw, body, request_id, self.created(), len(seqs))
        return await self._respond(
            ctx,
            flight,
            lambda: self._generate_stream(ctx, flight, seqs),
            lambda: self._generate_full(ctx, flight, seqs),
        )

    def _generate_choice(
        self, ctx: Ctx, seq: Seq, start: int, end: int, finish: str | None, versions: Any
    ) -> JSON:
        s = seq.sample
        count = ctx.body["sampling_params"].get("logprobs")
        text_mode = ctx.body.get("output_mode") == "text"
        choice: JSON = {
            "index": seq.index,
            "finish_reason": finish,
            "stop_reason": s.stop_reason if finish not in (None, "abort") else None,
            "token_ids": list(s.token_ids[start:end]),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": versions,
        }
        if text_mode:
            choice["text"] = "".join(s.deltas[start:end])
        logprobs = None
        if count is not None:
            if text_mode:
                logprobs = chat_logprobs(self.text, s, start, end, max(count, 1), False)
            else:
                logprobs = generate_logprobs(self.text, s, start, end, count)
        choice["logprobs"] = logprobs
        return choice

    async def _generate_full(self, ctx: Ctx, flight: Flight, seqs: list[Seq]) -> web.StreamResponse:
        await self._final(flight, seqs)
        prompt_ids = seqs[0].prompt_ids
        choices = [
            self._generate_choice(
                ctx,
                seq,
                0,
                len(seq.sample.token_ids),
                seq.sample.finish_reason,
                flight.weight_versions(len(seq.sample.token_ids)),
            )
            for seq in seqs
        ]
        return json_response(
            {
                "request_id": ctx.request_id,
                "model": self.model,
                "created": ctx.created,
                "usage": self._usage(len(prompt_ids), sum(len(s.sample.token_ids) for s in seqs)),
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": (
                    list(prompt_ids) if ctx.body.get("return_token_ids") else None
                ),
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": ctx.body.get("output_mode", "tokens"),
                "choices": choices,
            }
        )

    async def _generate_stream(
        self, ctx: Ctx, flight: Flight, seqs: list[Seq]
    ) -> web.StreamResponse:
        usage, continuous = usage_flags(ctx.body)
        mode = ctx.body.get("output_mode", "tokens")
        prompt_ids = seqs[0].prompt_ids
        pending_prompt = bool(ctx.body.get("return_token_ids"))
        sse = self._stream(ctx.request, spaced_error(generation_error()))
        await sse.open()

        def chunk(choice: JSON, generated: int) -> bytes:
            nonlocal pending_prompt
            out: JSON = {"request_id": ctx.request_id, "usage": None}
            if pending_prompt:
                out["prompt_token_ids"] = list(prompt_ids)
                pending_prompt = False
            if continuous:
                out["usage"] = self._short_usage(len(prompt_ids), generated)
            out["output_mode"] = mode
            out["choices"] = [choice]
            return dumps(out)

        def token(seq: Seq, step: int, finished: bool) -> bytes:
            choice = self._generate_choice(
                ctx,
                seq,
                step,
                step + 1,
                seq.sample.finish_reason if finished else None,
                flight.weight_versions(step + 1) if finished else None,
            )
            return chunk(choice, step + 1)

        def closing(seq: Seq, emitted: int) -> bytes:
            choice = self._generate_choice(
                ctx, seq, emitted, emitted, "abort", flight.weight_versions(emitted)
            )
            return chunk(choice, emitted)

        def tail(completion: int) -> bytes:
            return dumps(
                {
                    "request_id": ctx.request_id,
                    "usage": self._short_usage(len(prompt_ids), completion),
                    "output_mode": mode,
                    "choices": [],
                }
            )

        return await self._emit(sse, flight, seqs, token, closing, tail if usage else None)
