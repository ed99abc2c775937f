"""What the fake SGLang's route families share: the server, pacing, request bodies, 400s.

SGLang's `/generate`, its OpenAI-compatible routes and its control routes all run on the one
FastAPI app of `srt/entrypoints/http_server.py` (sglang 0.5.23); what they share, how a
generation is tracked and how a malformed body is refused, lives here once. So does what the
completions and chat routes share, as SGLang's `srt/entrypoints/openai/serving_base.py` and
`usage_processor.py` hold it for them: the `BadRequestError` body, usage, the weight-version
`metadata`, sampling parameters read from an OpenAI body, `matched_stop`.

Every route admits a prompt the same way, so the limits live here too: the tokenizer manager's
length checks (`TokenizerManager._validate_one_request`), the scheduler's own input bound and
new-token budget (`validate_input_length` in `srt/managers/utils.py`,
`Scheduler.init_req_max_new_tokens`), and what an empty prompt does to the server (nothing
before the scheduler refuses one; its forward pass fails on it and the server exits).
"""

from __future__ import annotations

import asyncio
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
SCHEDULER_RESERVE = 6  # max_req_input_len = min(context, KV pool) - 1 - 5 (`TpModelWorker`)


class Refused(ValueError):
    """A request the tokenizer manager refuses before generation: a `ValueError`, which
    `/generate` answers 400 `{"error": {"message"}}` and the OpenAI routes 400 `BadRequestError`."""


def check_prompt_length(prompt_tokens: int, max_new_tokens: int | None, context: int) -> None:
    """`TokenizerManager._validate_one_request`: a prompt that fills the context, or one whose
    explicit `max_new_tokens` would run past it, is refused with the manager's text."""
    if prompt_tokens >= context:
        raise Refused(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if max_new_tokens is not None and max_new_tokens + prompt_tokens > context:
        raise Refused(
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {max_new_tokens + prompt_tokens} "
            f"tokens: {prompt_tokens} tokens from the input messages and {max_new_tokens} "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )


def scheduler_refusal(prompt_tokens: int, context: int) -> str | None:
    """The scheduler's `validate_input_length` (`srt/managers/utils.py`): a prompt that passed
    the manager but leaves less than the scheduler's reserve is aborted with status 400."""
    limit = context - SCHEDULER_RESERVE
    if prompt_tokens < limit:
        return None
    return (
        f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({limit} "
        "tokens). Use a shorter input or enable --allow-auto-truncate."
    )


def new_token_budget(prompt_tokens: int, requested: int | None, context: int) -> int:
    """`Scheduler.init_req_max_new_tokens`: what was asked (unbounded if nothing was), capped
    to `max_req_len - prompt - 1` with `max_req_len = context - 1`."""
    rest = max(0, context - 2 - prompt_tokens)
    return rest if requested is None else max(0, min(requested, rest))


class SGLangBase(SimulatedServer):
    """The fake SGLang's shared request handling; the route families build on it."""

    incremental_streaming_output: bool
    tool_call_parser: str | None
    workers: list[str]
    process_groups: list[str]
    crashed: bool
    _open: set[asyncio.BaseTransport]  # connections with a request being answered

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.append(self._while_alive)
        return app

    @web.middleware
    async def _while_alive(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """Once crashed, the server is gone: every connection is dropped unanswered."""
        if self.crashed or request.transport is None:
            return await self._cut(request)
        transport = request.transport
        self._open.add(transport)
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            self._open.discard(transport)

    async def _crash(self, request: web.Request) -> web.StreamResponse:
        """An empty prompt reached the scheduler. SGLang refuses none before it (the contract,
        `validate_optional_list_i64_1d_2d` and `_validate_one_request` all let `[]` rows
        through); its forward pass fails on a batch of empty prompts, `run_scheduler_process`
        sends SIGQUIT to the server and `SignalHandler.running_phase_sigquit_handler` kills the
        process tree. Every open connection drops unanswered, and so does every later one."""
        self.crashed = True
        for transport in list(self._open):
            if transport is not request.transport:
                transport.close()
        return await self._cut(request)

    @staticmethod
    async def _cut(request: web.Request) -> web.StreamResponse:
        """Drop the connection without an answer; the server (started with handler
        cancellation) cancels this handler when the connection goes."""
        if request.transport is not None:
            request.transport.close()
        await asyncio.Event().wait()
        raise ConnectionResetError("the server is gone")

    async def track(
        self, flight: Flight, request_ids: Sequence[str], run: Callable[[], Any]
    ) -> Any:
        """As `SimulatedServer.track`, but a request cut by the crash was not abandoned by its
        client, so it is not listed in `aborted`."""
        try:
            return await run()
        except (asyncio.CancelledError, ConnectionResetError):
            flight.aborted = True
            if not self.crashed:
                for request_id in request_ids:
                    self.abort_log.record(request_id)
            raise
        finally:
            self.engine.release(flight)

    def _check_length(self, prompt_tokens: int, max_new_tokens: int | None) -> None:
        check_prompt_length(prompt_tokens, max_new_tokens, self.text.max_model_len)

    def _scheduler_refusal(self, prompt_tokens: int) -> str | None:
        return scheduler_refusal(prompt_tokens, self.text.max_model_len)

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
    def _validation_error(errors: list[JSON]) -> web.Response:
        """FastAPI's `RequestValidationError` as SGLang's handler renders it (`http_server.py`
        `validation_exception_handler`): `str(exc)` then `str(exc.errors())`, as a 400 legacy
        `ErrorResponse`. FastAPI's `str(exc)` also names the endpoint's source file and line,
        which belong to the server's machine; the fake leaves that line out."""
        lines = "".join(f"  {error}\n" for error in errors)
        plural = "s" if len(errors) != 1 else ""
        summary = f"{len(errors)} validation error{plural}:\n{lines}".rstrip()
        return SGLangBase._bad_request(f"{summary} {errors}")

    def _openai_body(self, request: web.Request, raw: bytes, required: str) -> JSON | web.Response:
        """The body FastAPI hands an OpenAI route, or its 400: `validate_json_request` (the
        content type), the JSON decode, an object with the `required` field."""
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return self._validation_error(
                [{"loc": ["header", "content-type"],
                  "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                  "type": "value_error"}]
            )  # fmt: skip
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return self._validation_error(
                [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                  "input": {}, "ctx": {"error": exc.msg}}]
            )  # fmt: skip
        if not isinstance(body, dict):
            return self._validation_error(
                [{"type": "model_attributes_type", "loc": ("body",),
                  "msg": "Input should be a valid dictionary or object to extract fields from",
                  "input": body}]
            )  # fmt: skip
        if required not in body:
            return self._validation_error(
                [{"type": "missing", "loc": ("body", required), "msg": "Field required",
                  "input": body}]
            )  # fmt: skip
        return body

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

    def _openai_error(
        self, message: str, code: int = 400, err_type: str = "BadRequestError"
    ) -> web.Response:
        """`OpenAIServingBase.create_error_response`: a validation message or a `ValueError` the
        manager raised (both 400 `BadRequestError`; the kick-started stream's too)."""
        return json_response(self._openai_error_body(message, code, err_type), code)

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
        if not flight.version_starts:  # aborted before its first step
            return {"weight_version": self.engine.weight_version, "weight_versions": []}
        spans = flight.weight_versions(count)
        return {"weight_version": spans[-1]["version"], "weight_versions": spans}

    def _openai_max_tokens(self, body: JSON, default_max: int | None) -> int | None:
        """The `max_new_tokens` an OpenAI body asks for: completions default to 16
        (`CompletionRequest.max_tokens`), chat to none (the rest of the context)."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
        return asked if isinstance(asked, int) else None

    def _openai_params(
        self, body: JSON, prompt_len: int, default_max: int | None, skip_special: bool = True
    ) -> SampleParams:
        """Sampling as the serving classes map it, the budget as the scheduler caps it."""
        stop = body.get("stop") or []
        asked = self._openai_max_tokens(body, default_max)
        return SampleParams(
            max_tokens=new_token_budget(prompt_len, asked, self.text.max_model_len),
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
    def _openai_error_body(message: str, code: int, err_type: str = "BadRequestError") -> JSON:
        return {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": None,
            "code": code,
        }

    def _refused_event(self, message: str) -> bytes:
        """A stream whose request the scheduler aborted with status 400: the serving classes
        send `create_streaming_error_response(message, "BAD_REQUEST", 400)` and stop reading."""
        return json.dumps({"error": self._openai_error_body(message, 400, "BAD_REQUEST")}).encode()

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
