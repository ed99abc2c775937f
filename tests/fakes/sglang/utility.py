"""What clients and trainers read before they generate: health, model and server info, models.

Follows sglang 0.5.23 `srt/entrypoints/http_server.py`: `/health` and `/health_generate`,
`/model_info` and `/server_info` (and their older `get_` names) with the fields SGLang sends,
and `/v1/models` with its one model card.
"""

from __future__ import annotations

import time

from aiohttp import web

from trace_proxy.demo.simulated_vllm import FIXED_CREATED, json_response

from .base import SGLANG_VERSION, SGLangBase


class UtilityRoutes(SGLangBase):
    """Health checks, model and server info, the model list."""

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

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
