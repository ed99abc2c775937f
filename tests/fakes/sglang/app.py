"""`FakeSGLang`: SGLang 0.5.23's HTTP server (`srt/entrypoints/http_server.py`), simulated."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    FIXED_CREATED,
    JSON,
    json_response,
)

from .base import SGLANG_VERSION
from .chat import ChatRoutes
from .completions import CompletionsRoutes
from .generate import GenerateRoutes

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class FakeSGLang(GenerateRoutes, CompletionsRoutes, ChatRoutes):
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
