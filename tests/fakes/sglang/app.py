"""`FakeSGLang`: SGLang 0.5.23's HTTP server (`srt/entrypoints/http_server.py`), simulated."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    FIXED_CREATED,
    JSON,
    Flight,
    Sample,
    SampleParams,
    SimulatedServer,
    SSEStream,
    dumps,
    hermes_extract,
    json_response,
)

from .contract import contract_error

SGLANG_VERSION = "0.5.23"
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass
class _Seq:
    """One output sequence of a `/generate` request."""

    position: int  # index in the response list / the streamed `index`
    rid: str
    prompt_ids: tuple[int, ...]
    sample: Sample
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    max_new_tokens: int


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) and value[i] is not None else default
    return default if value is None else value


class FakeSGLang(SimulatedServer):
    """SGLang 0.5.23's HTTP server, simulated for tests.

    Same knobs as `SimulatedVLLM` (`deterministic`, `token_delay`, `keepalive_comments`,
    `error_after_chunks`) plus `incremental_streaming_output` (the server flag
    `--incremental-streaming-output`) and `tool_call_parser` (None: no parsing on
    `/v1/chat/completions`). Inspect `requests`, `aborted` / `wait_aborted()`,
    `engine.weight_version`, `engine.paused` and `workers` (router registrations).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        model: str = "tiny-qwen",
        deterministic: bool = False,
        token_delay: float = 0.0,
        keepalive_comments: bool = False,
        error_after_chunks: int | None = None,
        incremental_streaming_output: bool = False,
        tool_call_parser: str | None = "qwen25",
    ) -> None:
        super().__init__(
            tokenizer,
            model=model,
            deterministic=deterministic,
            token_delay=token_delay,
            keepalive_comments=keepalive_comments,
            error_after_chunks=error_after_chunks,
        )
        self.incremental_streaming_output = incremental_streaming_output
        self.tool_call_parser = tool_call_parser
        self.workers: list[str] = []
        self.process_groups: list[str] = []

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self._empty)
        r.add_get("/model_info", self._model_info)
        r.add_get("/get_model_info", self._model_info)
        r.add_get("/server_info", self._server_info)
        r.add_get("/get_server_info", self._server_info)
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_get("/flush_cache", self._flush_cache)
        r.add_post("/flush_cache", self._flush_cache)
        r.add_post("/abort_request", self._abort_request)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_post("/update_weights_from_disk", self._update_from_disk)
        r.add_post("/init_weights_update_group", self._init_group)
        r.add_post("/destroy_weights_update_group", self._destroy_group)
        r.add_post("/update_weights_from_distributed", self._update_from_distributed)
        r.add_post("/update_weights_from_tensor", self._update_from_tensor)
        r.add_post("/begin_weight_update", self._success)
        r.add_post("/end_weight_update", self._success)
        r.add_post("/update_weight_version", self._update_weight_version)
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r.add_get(path, self._null)
            r.add_post(path, self._null)
        r.add_post("/v1/completions", self._openai_completions)
        r.add_post("/v1/chat/completions", self._openai_chat)
        r.add_get("/v1/models", self._models)
        r.add_get("/workers", self._list_workers)
        r.add_post("/workers", self._add_worker)
        r.add_delete("/workers/{url:.+}", self._remove_worker)
        r.add_post("/add_worker", self._add_worker)
        r.add_post("/remove_worker", self._remove_worker)
        r.add_get("/list_workers", self._list_workers)

    # -- /generate ----------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self._bad_request(f"JSON decode error: {exc}")
        error = contract_error(body)
        if error is not None:
            return json_response({"error": error}, 400)
        stream = bool(body.get("stream"))
        try:
            seqs, single = self._expand(body, raw)
        except ValueError as exc:
            if stream:
                return await self._stream_error(request, str(exc))
            return json_response({"error": {"message": str(exc)}}, 400)
        flight = self.engine.admit(seq.rid for seq in seqs)
        started = time.perf_counter()
        rids = [seq.rid for seq in seqs]
        if stream:
            return await self._run(
                flight, rids, lambda: self._generate_stream(request, body, seqs, single, flight)
            )
        return await self._run(
            flight, rids, lambda: self._generate_full(body, seqs, single, flight, started)
        )

    async def _run(
        self, flight: Flight, rids: Sequence[str], run: Callable[[], Any]
    ) -> web.StreamResponse:
        response: web.StreamResponse = await self.track(flight, rids, run)
        return response

    def _expand(self, body: JSON, raw: bytes) -> tuple[list[_Seq], bool]:
        """`GenerateReqInput.normalize_batch_and_arguments` + the manager's n-expansion."""
        text: Any = body.get("text")
        input_ids: Any = body.get("input_ids")
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            single = isinstance(text, str)
            prompts = [self.text.encode(t, True) for t in ([text] if single else text)]
        else:
            if len(input_ids) == 0:
                raise ValueError("input_ids cannot be empty.")
            single = isinstance(input_ids[0], int)
            prompts = [tuple(input_ids)] if single else [tuple(row) for row in input_ids]
        params_in = body.get("sampling_params") or {}
        all_params = params_in if isinstance(params_in, list) else [params_in] * len(prompts)
        n = int((all_params[0] if all_params else {}).get("n") or 1)
        if any(int(p.get("n") or 1) != n for p in all_params):
            raise ValueError(
                "The parallel_sample_num should be the same for all samples in sample params."
            )
        rid = body.get("rid")
        if single and n == 1:
            rids = [rid if isinstance(rid, str) else self.new_id(raw, "rid", size=16)]
        elif n > 1:  # the manager gives every sample a fresh uuid
            rids = [self.new_id(raw, "rid", str(i), size=16) for i in range(len(prompts) * n)]
        elif rid is None:
            rids = [self.new_id(raw, "rid", str(i), size=16) for i in range(len(prompts))]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(len(prompts))]
        else:
            if len(rid) != len(prompts):
                raise ValueError(
                    "The specified rids length mismatch with the batch_size for batch processing."
                )
            rids = list(rid)
        if len(set(rids)) != len(rids):
            duplicates = sorted({r for r in rids if rids.count(r) > 1})
            raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
        seqs: list[_Seq] = []
        for p, prompt_ids in enumerate(prompts):
            sp = all_params[p] if p < len(all_params) else {}
            params = self._params(sp, len(prompt_ids))
            for j in range(n):
                position = len(seqs)
                seed = self.text.seed_for(prompt_ids, j, params)
                sample = self.text.sample(self.text.plan(prompt_ids, seed), params, seed)
                seqs.append(
                    _Seq(
                        position,
                        rids[position],
                        prompt_ids,
                        sample,
                        bool(_per_item(body.get("return_logprob"), p, False)),
                        int(_per_item(body.get("top_logprobs_num"), p, 0)),
                        int(_per_item(body.get("logprob_start_len"), p, -1)),
                        params.max_tokens,
                    )
                )
        return seqs, single and n == 1

    def _params(self, sp: JSON, prompt_len: int) -> SampleParams:
        stop = sp.get("stop") or []
        max_new = sp.get("max_new_tokens")
        limit = self.text.max_model_len - prompt_len
        return SampleParams(
            max_tokens=min(128 if max_new is None else max_new, limit),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos")),
            skip_special_tokens=sp.get("skip_special_tokens") is not False,
            seed=sp.get("sampling_seed"),
            greedy=sp.get("temperature") == 0 or sp.get("top_k") == 1,
        )

    def _finish_reason(self, seq: _Seq, count: int, aborted: bool) -> JSON:
        s = seq.sample
        if aborted:
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        if s.finish_reason == "length":
            return {"type": "length", "length": count}
        matched = s.stop_reason if s.stop_reason is not None else s.token_ids[count - 1]
        return {"type": "stop", "matched": matched}

    def _logprob_fields(self, seq: _Seq, body: JSON, start: int, end: int) -> JSON:
        with_text = bool(body.get("return_text_in_logprobs"))

        def entry(token: int, logprob: float | None) -> list[Any]:
            return [logprob, token, self.text.token_text(token) if with_text else None]

        s = seq.sample
        fields: JSON = {}
        inputs: list[list[Any]] = []
        input_tops: list[list[list[Any]] | None] = []
        if seq.logprob_start_len >= 0:
            for pos in range(seq.logprob_start_len, len(seq.prompt_ids)):
                token = seq.prompt_ids[pos]
                logprob = None if pos == 0 else -round((hash((pos, token)) % 9000) / 1000, 4)
                inputs.append(entry(token, logprob))
                input_tops.append(
                    None
                    if logprob is None
                    else [
                        entry(t, lp)
                        for t, lp in self.text.candidates(token, logprob, seq.top_logprobs_num)
                    ]
                )
        fields["input_token_logprobs"] = inputs
        fields["output_token_logprobs"] = [
            entry(s.token_ids[i], s.logprobs[i]) for i in range(start, end)
        ]
        fields["output_token_logprobs_length"] = end
        if seq.top_logprobs_num > 0:
            fields["input_top_logprobs"] = input_tops
            fields["output_top_logprobs"] = [
                [
                    entry(t, lp)
                    for t, lp in self.text.candidates(
                        s.token_ids[i], s.logprobs[i], seq.top_logprobs_num
                    )
                ]
                for i in range(start, end)
            ]
        return fields

    def _meta_info(
        self,
        seq: _Seq,
        body: JSON,
        *,
        start: int,
        end: int,
        finished: bool,
        aborted: bool,
        flight: Flight,
        elapsed: float,
        first: bool,
    ) -> JSON:
        """meta_info in the tokenizer manager's key order."""
        meta: JSON = {
            "id": seq.rid,
            "finish_reason": self._finish_reason(seq, end, aborted) if finished else None,
            "prompt_tokens": len(seq.prompt_ids),
            "weight_version": self.engine.weight_version,
            "num_retractions": 0,
        }
        if seq.return_logprob:
            meta.update(self._logprob_fields(seq, body, start, end))
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = end
        meta["cached_tokens"] = 0
        if finished:
            spans = flight.weight_versions(end)
            meta["weight_versions"] = spans
            if spans:
                meta["weight_version"] = spans[-1]["version"]
            meta["e2e_latency"] = round(0.001 * (end + 1), 6) if self.deterministic else elapsed
        if first:
            meta["response_sent_to_client_ts"] = (
                FIXED_CREATED + 0.5 if self.deterministic else time.time()
            )
        return meta

    def _out(self, seq: _Seq, body: JSON, text: str, ids: list[int], meta: JSON) -> JSON:
        out: JSON = {"text": text, "output_ids": ids, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = list(seq.prompt_ids)
        return out

    async def _generate_full(
        self, body: JSON, seqs: list[_Seq], single: bool, flight: Flight, started: float
    ) -> web.StreamResponse:
        longest = max(len(seq.sample.token_ids) for seq in seqs)
        steps = await self.engine.run(flight, longest)
        if self.error_after_chunks is not None:
            return json_response({"error": {"message": "Internal server error"}}, 500)
        elapsed = time.perf_counter() - started
        outs = []
        for seq in seqs:
            count = min(steps, len(seq.sample.token_ids))
            aborted = count < len(seq.sample.token_ids)
            sample = seq.sample.prefix(count) if aborted else seq.sample
            meta = self._meta_info(
                seq,
                body,
                start=0,
                end=count,
                finished=True,
                aborted=aborted,
                flight=flight,
                elapsed=elapsed,
                first=True,
            )
            outs.append(self._out(seq, body, sample.text, list(sample.token_ids), meta))
        return json_response(outs[0] if single else outs)

    async def _generate_stream(
        self, request: web.Request, body: JSON, seqs: list[_Seq], single: bool, flight: Flight
    ) -> web.StreamResponse:
        started = time.perf_counter()
        sse = SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=dumps(self._stream_error_body("Internal server error", 500)),
        )
        await sse.open()
        emitted = {seq.position: 0 for seq in seqs}
        longest = max(len(seq.sample.token_ids) for seq in seqs)

        async def send(seq: _Seq, end: int, finished: bool, aborted: bool) -> bool:
            start = emitted[seq.position] if self.incremental_streaming_output else 0
            first = emitted[seq.position] == 0
            emitted[seq.position] = end
            s = seq.sample
            meta = self._meta_info(
                seq,
                body,
                start=start,
                end=end,
                finished=finished,
                aborted=aborted,
                flight=flight,
                elapsed=time.perf_counter() - started,
                first=first,
            )
            text = "".join(s.deltas[start:end])
            out = self._out(seq, body, text, list(s.token_ids[start:end]), meta)
            if not single:
                out["index"] = seq.position
            return await sse.send(dumps(out))

        async for step in self.steps(flight, longest):
            for seq in seqs:
                count = len(seq.sample.token_ids)
                if step < count and not await send(seq, step + 1, step + 1 == count, False):
                    return await sse.finish()
        for seq in seqs:  # aborted: every unfinished sequence ends with an abort reason
            if emitted[seq.position] < len(seq.sample.token_ids):
                end = emitted[seq.position]
                seq.sample = seq.sample.prefix(end)
                if not await send(seq, end, True, True):
                    return await sse.finish()
        return await sse.finish()

    @staticmethod
    def _stream_error_body(message: str, code: int) -> JSON:
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": code,
                "retryable": False,
            }
        }

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        """A ValueError raised once streaming began: an error event, then `[DONE]`, on a 200."""
        sse = SSEStream(request, keepalive=False, error_after=None, error_event=b"")
        await sse.open()
        await sse.send(dumps(self._stream_error_body(message, 400)))
        return await sse.finish()

    @staticmethod
    def _bad_request(message: str) -> web.Response:
        """FastAPI's RequestValidationError as SGLang renders it (its legacy ErrorResponse)."""
        return json_response(
            {
                "object": "error",
                "message": message,
                "type": "Bad Request",
                "param": None,
                "code": 400,
            },
            400,
        )

    # -- OpenAI-compatible routes (SGLang flavour) -------------------------------------------

    def _openai_error(self, message: str, code: int = 400) -> web.Response:
        return json_response(
            {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": code,
            },
            code,
        )

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> JSON:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _metadata(self, flight: Flight, count: int) -> JSON:
        spans = flight.weight_versions(count)
        return {"weight_version": spans[-1]["version"], "weight_versions": spans}

    def _openai_params(
        self, body: JSON, prompt_len: int, default_max: int | None, skip_special: bool = True
    ) -> SampleParams:
        """Completions default to 16 new tokens; chat to the rest of the context."""
        stop = body.get("stop") or []
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
        limit = self.text.max_model_len - prompt_len
        return SampleParams(
            max_tokens=limit if max_tokens is None else min(max_tokens, limit),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            skip_special_tokens=skip_special,
            seed=body.get("seed"),
            greedy=body.get("temperature") == 0,
        )

    def _matched_stop(self, sample: Sample) -> int | str | None:
        if sample.finish_reason != "stop":
            return None
        return sample.stop_reason if sample.stop_reason is not None else sample.token_ids[-1]

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
        sse = SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=json.dumps(
                {"error": self._openai_error_body("Internal server error", 500)}
            ).encode(),
        )
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

    @staticmethod
    def _openai_error_body(message: str, code: int) -> JSON:
        return {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": code,
        }

    def _tool_call_id(self, raw: bytes, choice: int, call: int) -> str:
        return "call_" + self.new_id(raw, "call", str(choice), str(call), size=12)

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        if "messages" not in body:
            return self._bad_request("Field required: messages")
        stream = bool(body.get("stream"))
        if stream and body.get("return_prompt_token_ids"):
            return self._openai_error(
                "return_prompt_token_ids is not supported with streaming. Please set "
                "stream=false when using return_prompt_token_ids=true."
            )
        if stream and body.get("return_token_ids"):
            return self._openai_error(
                "return_token_ids is not supported with streaming on /v1/chat/completions. "
                "Please set stream=false when using return_token_ids=true."
            )
        messages, tools = body["messages"], body.get("tools") or []
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        parses = bool(self.tool_call_parser and tools and tool_choice != "none")
        _, prompt_ids = self.text.render_chat(
            messages, tools, template_kwargs=body.get("chat_template_kwargs")
        )
        params = self._openai_params(body, len(prompt_ids), None, skip_special=not parses)
        samples = []
        for j in range(int(body.get("n") or 1)):
            seed = self.text.seed_for(prompt_ids, j, params)
            plan = self.text.plan_chat(messages, tools, tool_choice, seed)
            samples.append(self.text.sample(plan, params, seed))
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) else self.new_id(raw, "rid", size=16)
        flight = self.engine.admit([rid])
        created = self.created()
        model = body.get("model", "default")

        async def run() -> web.StreamResponse:
            if stream:
                return await self._chat_stream(
                    request, body, raw, rid, model, created, samples, parses, flight, prompt_ids
                )
            longest = max(len(s.token_ids) for s in samples)
            steps = await self.engine.run(flight, longest)
            samples[:] = [s if steps >= len(s.token_ids) else s.prefix(steps) for s in samples]
            choices = []
            for i, s in enumerate(samples):
                content, calls = self._parse_calls(s.text, parses, raw, i)
                message: JSON = {"role": "assistant", "content": content or ""}
                message["reasoning_content"] = None
                if calls:
                    message["tool_calls"] = calls
                finish = "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason
                choice: JSON = {
                    "index": i,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": None if calls else self._matched_stop(s),
                }
                if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
                    choice["prompt_token_ids"] = list(prompt_ids)
                if body.get("return_token_ids"):
                    choice["response_token_ids"] = list(s.token_ids)
                choices.append(choice)
            completion = sum(len(s.token_ids) for s in samples)
            return json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": choices,
                    "usage": self._usage(len(prompt_ids), completion),
                    "metadata": self._metadata(flight, len(samples[0].token_ids)),
                }
            )

        return await self._run(flight, [rid], run)

    def _parse_calls(
        self, text: str, parses: bool, raw: bytes, choice: int
    ) -> tuple[str | None, list[JSON]]:
        """(content, tool_calls) as SGLang's qwen25 detector returns them."""
        extracted = hermes_extract(text) if parses else None
        if extracted is None:
            return text, []
        content, calls = extracted
        return content, [
            {
                "id": self._tool_call_id(raw, choice, k),
                "index": k,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for k, (name, arguments) in enumerate(calls)
        ]

    async def _chat_stream(
        self,
        request: web.Request,
        body: JSON,
        raw: bytes,
        rid: str,
        model: str,
        created: int,
        samples: list[Sample],
        parses: bool,
        flight: Flight,
        prompt_ids: tuple[int, ...],
    ) -> web.StreamResponse:
        sse = SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=json.dumps(
                {"error": self._openai_error_body("Internal server error", 500)}
            ).encode(),
        )
        await sse.open()
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        def simple(index: int, delta: JSON, finish: str | None, matched: Any) -> bytes:
            """`build_sse_content`: msgspec, `reasoning_content` always, role/content if set."""
            choice = {
                "index": index,
                "delta": {"reasoning_content": None, **delta},
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
            return dumps({**head, "choices": [choice]})

        longest = max(len(s.token_ids) for s in samples)
        tool_sent = [False] * len(samples)
        async for step in self.steps(flight, longest):
            for i, s in enumerate(samples):
                if step == 0 and not await sse.send(
                    simple(i, {"role": "assistant", "content": ""}, None, None)
                ):
                    return await sse.finish()
                if step >= len(s.token_ids):
                    continue
                text = "".join(s.deltas[: step + 1])
                in_call = parses and "<tool_call>" in text
                if in_call:
                    _, calls = self._parse_calls(text, parses, raw, i)
                    if calls and not tool_sent[i]:
                        tool_sent[i] = True
                        for call in calls:
                            for fn in (
                                {"name": call["function"]["name"], "arguments": ""},
                                {"name": None, "arguments": call["function"]["arguments"]},
                            ):
                                tool_call = {
                                    "id": call["id"] if fn["name"] else None,
                                    "index": call["index"],
                                    "type": "function",
                                    "function": fn,
                                }
                                delta = {
                                    "role": None,
                                    "content": None,
                                    "reasoning_content": None,
                                    "tool_calls": [tool_call],
                                }
                                chunk = {
                                    **head,
                                    "choices": [
                                        {
                                            "index": i,
                                            "delta": delta,
                                            "logprobs": None,
                                            "finish_reason": None,
                                            "matched_stop": None,
                                        }
                                    ],
                                    "usage": None,
                                }
                                if not await sse.send(dumps(chunk)):
                                    return await sse.finish()
                elif s.deltas[step] and not await sse.send(
                    simple(i, {"content": s.deltas[step]}, None, None)
                ):
                    return await sse.finish()
        for i, s in enumerate(samples):
            finish = "tool_calls" if tool_sent[i] and s.finish_reason == "stop" else s.finish_reason
            matched = None if tool_sent[i] else self._matched_stop(s)
            if not await sse.send(simple(i, {}, finish, matched)):
                return await sse.finish()
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = {
                **head,
                "choices": [],
                "usage": self._usage(len(prompt_ids), sum(len(s.token_ids) for s in samples)),
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created(),
            "owned_by": "sglang",
            "root": self.model,
            "parent": None,
            "max_model_len": self.text.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    # -- control routes -----------------------------------------------------------------------

    async def _json(self, request: web.Request) -> JSON:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        return body if isinstance(body, dict) else {}

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _null(self, request: web.Request) -> web.Response:
        return json_response(None)

    async def _model_info(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "model_path": self.model,
                "served_model_name": self.model,
                "tokenizer_path": self.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": self.tool_call_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "served_model_name": self.model,
                "context_length": self.text.max_model_len,
                "incremental_streaming_output": self.incremental_streaming_output,
                "tool_call_parser": self.tool_call_parser,
                "weight_version": "default",
                "startup_time": FIXED_CREATED if self.deterministic else time.time(),
                "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}],
                "version": SGLANG_VERSION,
                "frontend": "python",
            }
        )

    async def _flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text=FLUSH_CACHE_TEXT, content_type="text/plain")

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid = str(body.get("rid") or "")
        if body.get("abort_all"):
            self.engine.abort()
        elif rid:  # the scheduler matches by prefix
            self.engine.abort(lambda r: r.startswith(rid))
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        mode = (await self._json(request)).get("mode", "abort")
        self.engine.pause(hold=True, reject_new=False, abort=mode == "abort")
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _set_version(self, body: JSON, message: str) -> str:
        version = body.get("weight_version")
        if version is not None:
            self.engine.weight_version = str(version)
            message += f" Weight version updated to {version}."
        if body.get("abort_all_requests"):
            self.engine.abort()
        return message

    def _missing(self, body: JSON, fields: Sequence[str]) -> web.Response | None:
        missing = [f for f in fields if f not in body]
        if not missing:
            return None
        errors = [{"type": "missing", "loc": ["body", f], "msg": "Field required"} for f in missing]
        return self._bad_request(f"{len(errors)} validation errors {errors}")

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if (error := self._missing(body, ["model_path"])) is not None:
            return error
        message = self._set_version(body, "Succeeded to update model weights.")
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _init_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        fields = ["master_address", "master_port", "rank_offset", "world_size"]
        if (error := self._missing(body, fields)) is not None:
            return error
        self.process_groups.append(str(body.get("group_name", "weight_update_group")))
        return json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        group = str(body.get("group_name", "weight_update_group"))
        if group in self.process_groups:
            self.process_groups.remove(group)
        return json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if (error := self._missing(body, ["names", "dtypes", "shapes"])) is not None:
            return error
        message = self._set_version(body, "Succeeded to update parameter online.")
        return json_response({"success": True, "message": message})

    async def _success(self, request: web.Request) -> web.Response:
        return json_response({"success": True, "message": "Success"})

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        return json_response({"success": True, "message": self._set_version(body, "Success")})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if (error := self._missing(body, ["new_version"])) is not None:
            return error
        if body.get("abort_all_requests", True):
            self.engine.abort()
        version = str(body["new_version"])
        self.engine.weight_version = version
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    # -- sgl-model-gateway worker registration (pass-through targets for slime) ---------------

    async def _add_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url") or str((await self._json(request)).get("url", ""))
        if not url:
            return json_response({"error": "url is required"}, 400)
        if url not in self.workers:
            self.workers.append(url)
        return json_response({"status": "accepted", "url": url, "message": f"Added {url}"})

    async def _remove_worker(self, request: web.Request) -> web.Response:
        url = request.match_info.get("url") or request.query.get("url", "")
        if url in self.workers:
            self.workers.remove(url)
        return json_response({"status": "accepted", "url": url, "message": f"Removed {url}"})

    async def _list_workers(self, request: web.Request) -> web.Response:
        if request.path == "/list_workers":
            return json_response({"urls": list(self.workers)})
        workers = [{"url": url, "is_healthy": True} for url in self.workers]
        return json_response({"workers": workers, "total": len(workers)})
