"""What the fake SGLang's route families share: the server, pacing, request bodies, 400s.

SGLang's `/generate`, its OpenAI-compatible routes and its control routes all run on the one
FastAPI app of `srt/entrypoints/http_server.py` (sglang 0.5.23); what they share, how a
generation is tracked and how a malformed body is refused, lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from trace_proxy.demo.simulated_vllm import JSON, Flight, SimulatedServer, json_response

SGLANG_VERSION = "0.5.23"


class SGLangBase(SimulatedServer):
    """The fake SGLang's shared request handling; the route families build on it."""

    incremental_streaming_output: bool
    tool_call_parser: str | None
    workers: list[str]
    process_groups: list[str]

    async def _run(
        self, flight: Flight, rids: Sequence[str], run: Callable[[], Any]
    ) -> web.StreamResponse:
        response: web.StreamResponse = await self.track(flight, rids, run)
        return response

    async def _json(self, request: web.Request) -> JSON:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        return body if isinstance(body, dict) else {}

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
