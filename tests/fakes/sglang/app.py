"""`FakeSGLang`: the route families put together, its knobs and its route table.

SGLang 0.5.23 mounts every route on the one FastAPI app of `srt/entrypoints/http_server.py`;
here each family is a mixin of its own (generate, completions, chat, control, utility, gateway)
and this class only chooses them, sets the knobs and maps the paths to their handlers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from trace_proxy.demo.simulated_vllm import DEFAULT_MAX_MODEL_LEN

from .chat import ChatRoutes
from .completions import CompletionsRoutes
from .control import ControlRoutes
from .gateway import GatewayRoutes
from .generate import GenerateRoutes
from .utility import UtilityRoutes


class FakeSGLang(
    GenerateRoutes, CompletionsRoutes, ChatRoutes, ControlRoutes, UtilityRoutes, GatewayRoutes
):
    """SGLang 0.5.23's HTTP server, simulated for tests.

    Same knobs as `SimulatedVLLM` (`deterministic`, `token_delay`, `keepalive_comments`,
    `error_after_chunks`) plus `incremental_streaming_output` (the server flag
    `--incremental-streaming-output`), `tool_call_parser` (None: no parsing on
    `/v1/chat/completions`) and `context_length` (`--context-length`, with a KV pool that
    holds it). Inspect `requests`, `aborted` / `wait_aborted()`, `engine.weight_version`,
    `engine.paused`, `workers` (router registrations) and `crashed` (an empty prompt killed
    the server: every connection since was dropped unanswered).
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
        context_length: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        super().__init__(
            tokenizer,
            model=model,
            deterministic=deterministic,
            token_delay=token_delay,
            keepalive_comments=keepalive_comments,
            error_after_chunks=error_after_chunks,
            max_model_len=context_length,
        )
        self.incremental_streaming_output = incremental_streaming_output
        self.tool_call_parser = tool_call_parser
        self.workers: list[str] = []
        self.process_groups: list[str] = []
        self.crashed = False
        self._open: set[asyncio.BaseTransport] = set()

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
