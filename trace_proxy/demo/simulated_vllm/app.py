"""The simulated vLLM server assembled: its knobs, its route table and the API-key check.

Each route family is a mixin of its own (chat, completions, generate, control, utility); this
class only chooses them, sets the knobs and maps paths to handlers, as vLLM's `api_server`
mounts its routers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from .base import VLLM_VERSION
from .chat import ChatRoutes
from .completions import CompletionsRoutes
from .control import ControlRoutes
from .generate import GenerateRoutes
from .utility import UtilityRoutes
from .wire import DEFAULT_MAX_MODEL_LEN, hex_digest, json_response


class SimulatedVLLM(ChatRoutes, CompletionsRoutes, GenerateRoutes, ControlRoutes, UtilityRoutes):
    """vLLM 0.33's OpenAI-compatible server, simulated.

    Knobs: `deterministic` (fixed `created`, ids hashed from the request body),
    `token_delay` (seconds per token step), `keepalive_comments` (`: keep-alive` between
    chunks), `error_after_chunks` (after N data chunks send vLLM's mid-stream error event and
    `[DONE]`; non-streaming requests then fail with a 500), `tool_call_parser` ("hermes" as
    with `--enable-auto-tool-choice --tool-call-parser hermes`, None for no tool parsing),
    `api_key` (Bearer check on `/v1` and `/inference`), `max_model_len`, `split_words` (answers
    whose token ids do not survive re-tokenization, see `TextModel`).

    Inspect `requests` (every request received), `aborted` / `wait_aborted()` (client
    disconnects), `engine.weight_version` and `engine.paused`.
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
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        tool_call_parser: str | None = "hermes",
        api_key: str | None = None,
        split_words: bool = False,
    ) -> None:
        super().__init__(
            tokenizer,
            model=model,
            deterministic=deterministic,
            token_delay=token_delay,
            keepalive_comments=keepalive_comments,
            error_after_chunks=error_after_chunks,
            max_model_len=max_model_len,
            split_words=split_words,
        )
        self.tool_call_parser = tool_call_parser
        self.api_key = api_key
        self.system_fingerprint = f"vllm-{VLLM_VERSION}-{hex_digest(model, size=4)}"

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self._auth)
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/inference/v1/generate", self._generate)
        r.add_get("/health", self._health)
        r.add_get("/ping", self._health)
        r.add_get("/version", self._version)
        r.add_get("/v1/models", self._models)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_post("/pause", self._pause)
        r.add_post("/resume", self._resume)
        r.add_get("/is_paused", self._is_paused)
        r.add_post("/abort_requests", self._abort_requests)
        r.add_post("/inference/v1/abort_requests", self._abort_requests)
        r.add_post("/init_weight_transfer_engine", self._message("Weight transfer initialized"))
        r.add_post("/start_weight_update", self._message("Weight update started"))
        r.add_post("/update_weights", self._message("Weights updated"))
        r.add_post("/finish_weight_update", self._finish_weight_update)
        r.add_post("/update_weight_version", self._update_weight_version)
        r.add_get("/weight_info", self._weight_info)

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        guarded = request.path.startswith(("/v1", "/v2", "/inference", "/cohere"))
        authorized = request.headers.get("Authorization") == f"Bearer {self.api_key}"
        if self.api_key and guarded and not authorized:
            return json_response({"error": "Unauthorized"}, 401)
        response: web.StreamResponse = await handler(request)
        return response
