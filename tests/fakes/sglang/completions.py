"""SGLang's OpenAI-compatible `/v1/completions`, whole and streamed.

Follows sglang 0.5.23 `srt/entrypoints/openai/serving_completions.py`: the rid as `id` (no
`cmpl-` prefix), `matched_stop` on every choice, `token_ids` and `prompt_token_ids` when
`return_token_ids` asks, 16 new tokens unless told otherwise, `metadata` with the weight
versions, and a usage-only chunk at the end of a stream when `stream_options.include_usage`.

Refusals are the serving classes' JSON 400s: FastAPI's validation of `CompletionRequest`,
`_validate_request`'s "Prompt cannot be empty", and the manager's `ValueError`s (a prompt too
long for the context), which a stream raises before its 200 (`_handle_streaming_request`
kick-starts the generator). A stream cut by `/abort_request` ends each unfinished choice with
the chunk SGLang makes of the abort: no new text, `finish_reason` `"abort"`. (That is the
default, cumulative streaming; with `--incremental-streaming-output` SGLang's abort chunk
re-sends the last token, which `_generate_chat_stream` trims from its ids; the fake sends no
new token in either mode.)
"""

from __future__ import annotations

from aiohttp import web

from trace_proxy.demo.simulated_vllm import JSON, Flight, Sample, dumps, json_response

from .base import SGLangBase


class CompletionsRoutes(SGLangBase):
    """`/v1/completions`: text, token-id and batched prompts, `n` choices each."""

    async def _openai_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = self._openai_body(request, raw, "prompt")
        if isinstance(body, web.Response):
            return body
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens <= 0:  # `validate_max_tokens_positive`
            return self._validation_error(
                [{"type": "value_error", "loc": ("body", "max_tokens"),
                  "msg": "Value error, max_tokens must be positive", "input": max_tokens,
                  "ctx": {"error": ValueError("max_tokens must be positive")}}]
            )  # fmt: skip
        prompt = body["prompt"]
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            return self._openai_error("Prompt cannot be empty")  # `_validate_request`
        if isinstance(prompt, str):
            prompts = [self.text.encode(prompt, True)]
        elif isinstance(prompt[0], int):
            prompts = [tuple(prompt)]
        else:
            prompts = [
                self.text.encode(p, True) if isinstance(p, str) else tuple(p) for p in prompt
            ]
        try:
            for ids in prompts:
                self._check_length(len(ids), self._openai_max_tokens(body, 16))
        except ValueError as exc:
            return self._openai_error(str(exc))
        if any(not ids for ids in prompts):
            return await self._crash(request)
        refusal = next(filter(None, (self._scheduler_refusal(len(ids)) for ids in prompts)), None)
        if refusal is not None and not body.get("stream"):
            return self._openai_error(refusal)
        n = int(body.get("n") or 1)
        samples = []
        for ids in prompts:
            params = self._openai_params(body, len(ids), 16)
            for j in range(n):
                seed = self.text.seed_for(ids, j, params)
                samples.append((ids, self.text.sample(self.text.plan(ids, seed), params, seed)))
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) else self.new_id(raw, "rid", size=16)
        flight = self.engine.admit([rid])
        model = body.get("model", "default")
        created = self.created()

        async def run() -> web.StreamResponse:
            longest = max(len(s.token_ids) for _, s in samples)
            if body.get("stream"):
                if refusal is not None:
                    return await self._refused_stream(request, body, rid, model, refusal)
                return await self._completions_stream(
                    request, body, rid, model, samples, flight, sum(len(i) for i in prompts)
                )
            steps = await self.engine.run(flight, longest)
            samples[:] = [
                (ids, s if steps >= len(s.token_ids) else s.prefix(steps)) for ids, s in samples
            ]
            choices = []
            for i, (ids, s) in enumerate(samples):
                choice: JSON = {
                    "index": i,
                    "text": s.text,
                    "logprobs": None,
                    "finish_reason": s.finish_reason,
                    "matched_stop": self._matched_stop(s),
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = list(s.token_ids)
                    choice["prompt_token_ids"] = list(ids)
                choices.append(choice)
            completion = sum(len(s.token_ids) for _, s in samples)
            return json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": choices,
                    "usage": self._usage(sum(len(ids) for ids in prompts), completion),
                    "metadata": self._metadata(flight, len(samples[0][1].token_ids)),
                }
            )

        return await self._run(flight, [rid], run)

    async def _completions_stream(
        self,
        request: web.Request,
        body: JSON,
        rid: str,
        model: str,
        samples: list[tuple[tuple[int, ...], Sample]],
        flight: Flight,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        sse = self._openai_stream(request)
        await sse.open()
        created = self.created()
        longest = max(len(s.token_ids) for _, s in samples)

        def chunk(i: int, ids: tuple[int, ...], s: Sample, step: int, last: bool) -> bytes:
            """One choice's chunk: the token at `step`, or (`step` past the tokens sent) the
            abort's, which adds no text."""
            sent = step < len(s.token_ids)
            choice: JSON = {
                "index": i,
                "text": s.deltas[step] if sent else "",
                "logprobs": None,
                "finish_reason": s.finish_reason if last else None,
                "matched_stop": self._matched_stop(s) if last else None,
            }
            if body.get("return_token_ids"):
                choice["token_ids"] = [s.token_ids[step]] if sent else []
                if step == 0:
                    choice["prompt_token_ids"] = list(ids)
            return dumps(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": None,
                }
            )

        done = 0
        async for step in self.steps(flight, longest):
            done = step + 1
            for i, (ids, s) in enumerate(samples):
                if step < len(s.token_ids):
                    last = step == len(s.token_ids) - 1
                    if not await sse.send(chunk(i, ids, s, step, last)):
                        return await sse.finish()
        for i, (ids, s) in enumerate(samples):  # aborted: what each choice had, then "abort"
            if done < len(s.token_ids):
                samples[i] = (ids, s.prefix(done))
                if not await sse.send(chunk(i, ids, samples[i][1], done, True)):
                    return await sse.finish()
        if (body.get("stream_options") or {}).get("include_usage"):
            completion = sum(len(s.token_ids) for _, s in samples)
            usage = {
                k: v for k, v in self._usage(prompt_tokens, completion).items() if v is not None
            }
            tail = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    async def _refused_stream(
        self, request: web.Request, body: JSON, rid: str, model: str, refusal: str
    ) -> web.StreamResponse:
        """A prompt the scheduler refused, streamed: its error event, the usage of the one
        token the refused request kept when asked for, `[DONE]` (`_generate_completion_stream`)."""
        sse = self._openai_stream(request)
        await sse.open()
        if not await sse.send(self._refused_event(refusal)):
            return await sse.finish()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0}
            tail = {
                "id": rid,
                "object": "text_completion",
                "created": self.created(),
                "model": model,
                "choices": [],
                "usage": usage,
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()
