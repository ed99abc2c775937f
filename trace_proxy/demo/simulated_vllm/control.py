"""vLLM's RL control routes, following vLLM 0.33's `rl/online/api_router.py`.

Trainers pause generation (`abort`, `wait` or `keep`), abort requests, push weights and name
the new weight version; the proxy records those around the rollouts, so each route answers
with the body and status vLLM sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from .base import VLLMBase
from .errors import VLLMError
from .parsing import read_body
from .wire import json_response


class ControlRoutes(VLLMBase):
    """Pause, resume, abort and weight-update routes, all acting on the engine."""

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return VLLMError(
                f"1 validation error:\n  {{'type': 'literal_error', 'loc': 'query.mode', 'msg': "
                f"\"Input should be 'abort', 'wait' or 'keep'\", 'input': {mode!r}, 'ctx': "
                "{'expected': \"'abort', 'wait' or 'keep'\"}}",
                "Bad Request",
                400,
                "query.mode",
            ).response()
        self.engine.pause(hold=mode == "keep", reject_new=mode != "keep", abort=mode == "abort")
        if mode == "wait":
            await self.engine.drained()
        return json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.engine.paused})

    async def _abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return VLLMError("Invalid JSON format", "Bad Request", 400).response()
        if not isinstance(body, dict):
            return VLLMError("Request body must be a JSON object", "Bad Request", 400).response()
        ids = body.get("request_ids")
        if request.path.startswith("/inference") and ids is None:
            return VLLMError("Missing 'request_ids' in request body", "Bad Request", 400).response()
        if ids:
            wanted = set(ids)
            count = self.engine.abort(lambda rid: rid in wanted)
            if request.path.startswith("/inference"):
                return web.Response(status=200)
            return json_response({"status": "aborted", "aborted": len(ids) or count})
        count = self.engine.abort()
        return json_response({"status": "aborted", "aborted": count})

    def _message(self, message: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            return json_response({"message": message})

        return handler

    async def _finish_weight_update(self, request: web.Request) -> web.Response:
        body: Any = {}
        if await request.read():  # no body at all: weight_version is optional
            try:  # a body that is not JSON is a 400, as FastAPI rejects it
                _, body = await read_body(request)
            except VLLMError as exc:
                return exc.response()
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            self.engine.weight_version = str(version)
        return json_response({"message": "Weight update finished"})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        try:
            _, body = await read_body(request, ("new_version",))
        except VLLMError as exc:
            return exc.response()
        self.engine.weight_version = str(body["new_version"])
        return json_response({"success": True, "new_version": body["new_version"]})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})
