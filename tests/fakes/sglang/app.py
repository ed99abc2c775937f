"""`FakeSGLang`: SGLang 0.5.23's HTTP server (`srt/entrypoints/http_server.py`), simulated."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    FIXED_CREATED,
    JSON,
    Flight,
    Sample,
    SampleParams,
    SSEStream,
    dumps,
    hermes_extract,
    json_response,
)

from .base import SGLANG_VERSION
from .generate import GenerateRoutes

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class FakeSGLang(GenerateRoutes):
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
