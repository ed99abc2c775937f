"""What the fake SGLang's route families share: the server, pacing, request bodies, 400s.

SGLang's `/generate`, its OpenAI-compatible routes and its control routes all run on the one
FastAPI app of `srt/entrypoints/http_server.py` (sglang 0.5.23); what they share, how a
generation is tracked and how a malformed body is refused, lives here once. So does what the
completions and chat routes share, as SGLang's `srt/entrypoints/openai/serving_base.py` and
`usage_processor.py` hold it for them: the `BadRequestError` body, usage, the weight-version
`metadata`, sampling parameters read from an OpenAI body, `matched_stop`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    JSON,
    Flight,
    Sample,
    SampleParams,
    SimulatedServer,
    SSEStream,
    json_response,
)

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

    def _openai_error(self, message: str, code: int = 400) -> web.Response:
        return json_response(self._openai_error_body(message, code), code)

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

    @staticmethod
    def _openai_error_body(message: str, code: int) -> JSON:
        return {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": code,
        }

    def _openai_stream(self, request: web.Request) -> SSEStream:
        """A completions or chat stream: the knobs, and a 500 `BadRequestError` as error event."""
        return SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=json.dumps(
                {"error": self._openai_error_body("Internal server error", 500)}
            ).encode(),
        )
