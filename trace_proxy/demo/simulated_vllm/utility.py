"""The small routes vLLM 0.33 serves beside the OpenAI ones (`serve/*`).

Health, version and the model card, and `/tokenize` / `/detokenize` with the simulator's real
tokenizer and chat template, so a client that counts tokens gets the numbers it would get.
"""

from __future__ import annotations

from aiohttp import web

from .base import VLLM_VERSION, VLLMBase
from .errors import VLLMError, missing_fields_error
from .parsing import read_body
from .wire import json_response


class UtilityRoutes(VLLMBase):
    """Health, version, models, tokenize and detokenize."""

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        created = self.created()
        permission = {
            "id": f"modelperm-{self.new_id(b'', 'modelperm')}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": self.model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.text.max_model_len,
            "permission": [permission],
        }
        return json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            _, body = await read_body(request)
            if "messages" in body:
                ids = self._render(body, body["messages"], body.get("tools") or [])
            elif isinstance(body.get("prompt"), str):
                ids = self.text.encode(body["prompt"], body.get("add_special_tokens", True))
            else:
                raise missing_fields_error(body, ["prompt"])
        except VLLMError as exc:
            return exc.response()
        strs = self.text.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.text.max_model_len,
                "tokens": list(ids),
                "token_strs": strs,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            _, body = await read_body(request, ("tokens",))
        except VLLMError as exc:
            return exc.response()
        return json_response({"prompt": self.text.decode(body["tokens"])})
