"""The control routes RL trainers call: flush the cache, abort, pause and continue, new weights.

Follows sglang 0.5.23 `srt/entrypoints/http_server.py` (the routes, their body validation and
their answers), with the messages the scheduler's weight updater sends back
(`srt/managers/scheduler_components/weight_updater.py`) and the tokenizer manager's weight
versions (`srt/managers/tokenizer_control_mixin.py`). A weight version named on the way becomes
the engine's, so later answers carry it in their spans; an abort matches rids by prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from trace_proxy.demo.simulated_vllm import JSON, json_response

from .base import SGLangBase

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class ControlRoutes(SGLangBase):
    """Cache flush, aborts, pause and continue, weight updates and versions, memory release."""

    async def _null(self, request: web.Request) -> web.Response:
        return json_response(None)

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
