"""SGLang's OpenAI-compatible `/v1/completions`, whole and streamed.

Follows sglang 0.5.23 `srt/entrypoints/openai/serving_completions.py`: the rid as `id` (no
`cmpl-` prefix), `matched_stop` on every choice, `token_ids` and `prompt_token_ids` when
`return_token_ids` asks, 16 new tokens unless told otherwise, `metadata` with the weight
versions, and a usage-only chunk at the end of a stream when `stream_options.include_usage`.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from trace_proxy.demo.simulated_vllm import JSON, Flight, Sample, dumps, json_response

from .base import SGLangBase


class CompletionsRoutes(SGLangBase):
    """`/v1/completions`: text, token-id and batched prompts, `n` choices each."""

    async def _openai_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self.text.encode(prompt, True)]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompts = [tuple(prompt)]
        elif isinstance(prompt, list) and prompt:
            prompts = [
                self.text.encode(p, True) if isinstance(p, str) else tuple(p) for p in prompt
            ]
        else:
            return self._bad_request("Field required: prompt")
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
        async for step in self.steps(flight, longest):
            for i, (ids, s) in enumerate(samples):
                if step >= len(s.token_ids):
                    continue
                finished = step == len(s.token_ids) - 1
                choice: JSON = {
                    "index": i,
                    "text": s.deltas[step],
                    "logprobs": None,
                    "finish_reason": s.finish_reason if finished else None,
                    "matched_stop": self._matched_stop(s) if finished else None,
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = [s.token_ids[step]]
                    if step == 0:
                        choice["prompt_token_ids"] = list(ids)
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": None,
                }
                if not await sse.send(dumps(chunk)):
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
