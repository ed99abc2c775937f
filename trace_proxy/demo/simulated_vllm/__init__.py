"""A simulated vLLM OpenAI-compatible server: real tokens, no model.

`trace-proxy demo`, the tests and the latency benchmarks need an upstream that speaks vLLM's
wire format byte for byte but runs anywhere in milliseconds. This one follows vLLM 0.33.0
(`vllm/entrypoints/openai/{completion,chat_completion}`, `scale_out/token_in_token_out`,
`rl/online/api_router.py`, `serve/*`) as described in the project's reference
`inference-apis.md`: field order and null handling of every response model, `exclude_unset`
streaming chunks, the usage-only final chunk, mid-stream error events, `ErrorResponse` 400s,
the RL control routes and weight-version spans.

The "model" is deterministic: the output is chosen from a hash of the prompt token ids, its
token ids are the real Qwen tokenizer's encoding of that text (+ `<|im_end|>` at a stop), chat
prompts are rendered with the tokenizer's chat template so `prompt_token_ids` are real, and with
`tools` it emits Hermes `<tool_call>` blocks that are parsed the way vLLM's `hermes` tool parser
does. ChatML prompts sent as raw text or token ids get the same answers as the chat route.

The pieces that are not vLLM-specific (`TextModel`, `Engine`, `AbortLog`, `SSEStream`,
`SimulatedServer`, `start_app`) are shared with the fake SGLang server in the tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from .chatml import ascii_text, message_text, parse_chatml, tool_rounds
from .engine import PAUSED_MESSAGE, Engine, Flight, Paused
from .hermes import TOOL_CALL_END, TOOL_CALL_START, HermesStream, hermes_extract
from .model import Sample, SampleParams, TextModel
from .server import AbortLog, RecordedRequest, SimulatedServer, start_app
from .sse import DONE, EVENT_STREAM, KEEPALIVE, SSEStream
from .wire import (
    DEFAULT_MAX_MODEL_LEN,
    FIXED_CREATED,
    JSON,
    dumps,
    hex_digest,
    json_response,
    random_uuid,
)

VLLM_VERSION = "0.33.0"

# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


class VLLMError(Exception):
    """An `ErrorResponse` to send: `{"error":{"message","type","param","code"}}`."""

    def __init__(self, message: str, err_type: str, code: int, param: str | None = None):
        super().__init__(message)
        self.message, self.err_type, self.code, self.param = message, err_type, code, param

    def body(self) -> JSON:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), self.code)


def validation_error(message: str, parameter: str, value: Any = None) -> VLLMError:
    """vLLM's `VLLMValidationError` as its exception handler renders it (400)."""
    extras = [f"parameter={parameter}"] + ([f"value={value}"] if value is not None else [])
    return VLLMError(f"{message} ({', '.join(extras)})", "BadRequestError", 400, parameter)


def missing_fields_error(body: JSON, fields: Sequence[str]) -> VLLMError:
    """FastAPI's RequestValidationError for missing body fields, as vLLM renders it."""
    entries = [
        str(
            {
                "type": "missing",
                "loc": f"body.{name}",
                "msg": "Field required",
                "input": f"<dict of {len(body)} items>",
            }
        )
        for name in fields
    ]
    label = "error" if len(entries) == 1 else "errors"
    message = f"{len(entries)} validation {label}:\n" + "".join(f"  {e}\n" for e in entries)
    return VLLMError(message.rstrip(), "Bad Request", 400, f"body.{fields[0]}")


def paused_error() -> VLLMError:
    return VLLMError(PAUSED_MESSAGE, "ServiceUnavailableError", 503)


def generation_error() -> VLLMError:
    return VLLMError("Internal server error", "InternalServerError", 500)


@dataclass
class _Seq:
    """One output sequence of a request: its choice index, prompt and planned sample."""

    index: int
    prompt_ids: tuple[int, ...]
    sample: Sample


class SimulatedVLLM(SimulatedServer):
    """vLLM 0.33's OpenAI-compatible server, simulated.

    Knobs: `deterministic` (fixed `created`, ids hashed from the request body),
    `token_delay` (seconds per token step), `keepalive_comments` (`: keep-alive` between
    chunks), `error_after_chunks` (after N data chunks send vLLM's mid-stream error event and
    `[DONE]`; non-streaming requests then fail with a 500), `tool_call_parser` ("hermes" as
    with `--enable-auto-tool-choice --tool-call-parser hermes`, None for no tool parsing),
    `api_key` (Bearer check on `/v1` and `/inference`), `max_model_len`.

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
    ) -> None:
        super().__init__(
            tokenizer,
            model=model,
            deterministic=deterministic,
            token_delay=token_delay,
            keepalive_comments=keepalive_comments,
            error_after_chunks=error_after_chunks,
            max_model_len=max_model_len,
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

    # -- request parsing ----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> tuple[bytes, JSON]:
        """The raw body and its JSON object, or a VLLMError as FastAPI would reject it."""
        media_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
        if media_type != "application/json":
            raise VLLMError(
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
                400,
            )
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            pos = getattr(exc, "pos", 0)
            msg = getattr(exc, "msg", str(exc))
            detail = {
                "type": "json_invalid",
                "loc": f"body.{pos}",
                "msg": "JSON decode error",
                "input": "<dict of 0 items>",
                "ctx": {"error": msg},
            }
            raise VLLMError(
                f"1 validation error:\n  {detail}", "Bad Request", 400, f"body.{pos}"
            ) from exc
        if not isinstance(body, dict):
            raise VLLMError(
                "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
                "'msg': 'Input should be a valid dictionary or object to extract fields from',"
                f" 'input': {ascii_text(body, 200)!r}}}",
                "Bad Request",
                400,
                "body",
            )
        return raw, body

    def _request_base_id(self, request: web.Request, body: JSON, raw: bytes) -> str:
        header = request.headers.get("X-Request-Id")
        if header is not None:
            return header
        if isinstance(body.get("request_id"), str):
            return str(body["request_id"])
        return self.new_id(raw, request.path)

    @staticmethod
    def _check_stream_options(body: JSON) -> None:
        if body.get("stream_options") and not body.get("stream"):
            raise validation_error(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )

    @staticmethod
    def _check_int_field(body: JSON, name: str) -> None:
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise validation_error(f"`{name}` must be an integer.", name, value)

    def _check_prompt_logprobs(self, body: JSON) -> None:
        self._check_int_field(body, "prompt_logprobs")
        prompt_logprobs = body.get("prompt_logprobs")
        if prompt_logprobs is not None:
            if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
                raise validation_error(
                    "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
                )
            if prompt_logprobs < 0 and prompt_logprobs != -1:
                raise validation_error(
                    "`prompt_logprobs` must be a positive value or -1.",
                    "prompt_logprobs",
                    prompt_logprobs,
                )

    def _params(
        self, body: JSON, prompt_len: int, max_tokens: int | None, skip_special: bool = True
    ) -> SampleParams:
        limit = self.text.max_model_len - prompt_len
        if limit < 0:
            raise VLLMError(
                f"Input length ({prompt_len}) exceeds model's maximum context length "
                f"({self.text.max_model_len}).",
                "BadRequestError",
                400,
            )
        stop = body.get("stop") or []
        skip = body.get("skip_special_tokens")
        return SampleParams(
            max_tokens=min(max_tokens, limit) if max_tokens is not None else limit,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            skip_special_tokens=skip_special if skip is None else bool(skip),
            seed=body.get("seed"),
            greedy=body.get("temperature") == 0,
        )

    def _sample(self, prompt_ids: tuple[int, ...], index: int, params: SampleParams) -> Sample:
        seed = self.text.seed_for(prompt_ids, index, params)
        return self.text.sample(self.text.plan(prompt_ids, seed), params, seed)

    def _prompt_logprobs(self, prompt_ids: Sequence[int], count: int) -> list[JSON | None]:
        """`prompt_logprobs`: None for the first token, then `{id: Logprob}` per position."""
        out: list[JSON | None] = [None]
        for pos, token in enumerate(prompt_ids[1:], start=1):
            logprob = -round((hash((pos, token)) % 9000) / 1000, 4)
            cands = self.text.candidates(token, logprob, max(count, 1))
            out.append(
                {
                    str(tid): {
                        "logprob": lp,
                        "rank": rank,
                        "decoded_token": self.text.token_text(tid),
                    }
                    for rank, (tid, lp) in enumerate(cands, start=1)
                }
            )
        return out

    def _token_str(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.text.token_text(token_id)

    def _completion_logprobs(
        self, sample: Sample, start: int, end: int, count: int, as_ids: bool, offset: int
    ) -> tuple[JSON, int]:
        """`CompletionLogProbs` for tokens [start, end) and the next text offset."""
        offsets, token_logprobs, tokens, tops = [], [], [], []
        for pos in range(start, end):
            token, logprob = sample.token_ids[pos], sample.logprobs[pos]
            text = self._token_str(token, as_ids)
            offsets.append(offset)
            offset += len(text)
            token_logprobs.append(logprob)
            tokens.append(text)
            top: JSON = {}
            for tid, lp in self.text.candidates(token, logprob, count)[: count + 1]:
                top.setdefault(self._token_str(tid, as_ids), lp)
            tops.append(top)
        body = {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        }
        return body, offset

    def _chat_logprobs(self, sample: Sample, start: int, end: int, top: int, as_ids: bool) -> JSON:
        """`ChatCompletionLogProbs` for tokens [start, end)."""
        content = []
        for pos in range(start, end):
            token, logprob = sample.token_ids[pos], sample.logprobs[pos]
            text = self._token_str(token, as_ids)
            alternatives = self.text.candidates(token, logprob, top)[: max(top, 0)]
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode("utf-8", errors="replace")),
                    "top_logprobs": [
                        {
                            "token": (alt := self._token_str(tid, as_ids)),
                            "logprob": lp,
                            "bytes": list(alt.encode("utf-8", errors="replace")),
                        }
                        for tid, lp in alternatives
                    ],
                }
            )
        return {"content": content}

    def _generate_logprobs(self, sample: Sample, start: int, end: int, count: int) -> JSON:
        """`GenerateLogProbs` (integer ids; every candidate the engine returned)."""
        content = []
        for pos in range(start, end):
            token, logprob = sample.token_ids[pos], sample.logprobs[pos]
            cands = self.text.candidates(token, logprob, count)
            content.append(
                {
                    "token_id": token,
                    "logprob": logprob,
                    "rank": 1,
                    "top_logprobs": [
                        {"token_id": tid, "logprob": lp, "rank": rank}
                        for rank, (tid, lp) in enumerate(cands, start=1)
                    ],
                }
            )
        return {"content": content}

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> JSON:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    @staticmethod
    def _short_usage(prompt_tokens: int, completion_tokens: int) -> JSON:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _stream(self, request: web.Request, error_event: bytes) -> SSEStream:
        return SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=error_event,
        )

    @staticmethod
    def _spaced_error(error: VLLMError) -> bytes:
        """`json.dumps(ErrorResponse.model_dump())`: how completions/generate stream errors."""
        return json.dumps(error.body()).encode()

    async def _run(
        self,
        request: web.Request,
        flight: Flight,
        request_id: str,
        run: Callable[[], Any],
    ) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await self.track(flight, [request_id], run)
        except VLLMError as exc:
            return exc.response()
        return response

    async def _final(self, flight: Flight, seqs: list[_Seq]) -> None:
        """Pace a non-streaming request; samples are cut short if it was aborted."""
        longest = max(len(s.sample.token_ids) for s in seqs)
        steps = await self.engine.run(flight, longest)
        for seq in seqs:
            if steps < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(steps)
        if self.error_after_chunks is not None:
            raise generation_error()

    # -- /v1/completions ----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await self._body(request)
            prompts = self._completion_prompts(body)
            self._check_stream_options(body)
            self._check_prompt_logprobs(body)
            self._check_int_field(body, "logprobs")
            logprobs = body.get("logprobs")
            if logprobs is not None and logprobs < 0 and logprobs != -1:
                raise validation_error(
                    "`logprobs` must be a positive value or -1.", "logprobs", logprobs
                )
            n = int(body.get("n") or 1)
            max_tokens = body.get("max_tokens")
            seqs = []
            for p_idx, ids in enumerate(prompts):
                params = self._params(body, len(ids), 16 if max_tokens is None else max_tokens)
                for j in range(n):
                    seqs.append(_Seq(p_idx * n + j, ids, self._sample(ids, j, params)))
            request_id = f"cmpl-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit(
                [request_id] + [f"{request_id}-{i}" for i in range(len(prompts))]
            )
        except VLLMError as exc:
            return exc.response()
        except Paused:
            if body.get("stream"):
                return await self._error_stream(request, self._spaced_error(paused_error()))
            return paused_error().response()
        ctx = _Ctx(request, raw, body, request_id, self.created(), n)
        if body.get("stream"):
            return await self._run(
                request, flight, request_id, lambda: self._completions_stream(ctx, flight, seqs)
            )
        return await self._run(
            request, flight, request_id, lambda: self._completions_full(ctx, flight, seqs)
        )

    def _completion_prompts(self, body: JSON) -> list[tuple[int, ...]]:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return [self.text.encode(prompt, add_special)]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [tuple(prompt)]
        if isinstance(prompt, list):
            out = []
            for item in prompt:
                if isinstance(item, str):
                    out.append(self.text.encode(item, add_special))
                elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                    out.append(tuple(item))
                else:
                    break
            else:
                return out
        raise VLLMError(
            "1 validation error:\n  {'type': 'union_tag_invalid', 'loc': 'body.prompt', "
            "'msg': 'Input should be a string, a list of strings, a list of token ids or a "
            f"list of token id lists', 'input': {ascii_text(prompt, 200)!r}}}",
            "Bad Request",
            400,
            "body.prompt",
        )

    async def _completions_full(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq]
    ) -> web.StreamResponse:
        await self._final(flight, seqs)
        body = ctx.body
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        logprobs = body.get("logprobs")
        token_ids = bool(body.get("return_token_ids"))
        prompt_logprobs = body.get("prompt_logprobs")
        choices: list[JSON] = []
        for seq in seqs:
            s = seq.sample
            lp = None
            if logprobs is not None:
                lp, _ = self._completion_logprobs(s, 0, len(s.token_ids), logprobs, as_ids, 0)
            choices.append(
                {
                    "index": len(choices),
                    "text": s.text,
                    "logprobs": lp,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": list(s.token_ids) if token_ids else None,
                    "prompt_logprobs": (
                        self._prompt_logprobs(seq.prompt_ids, prompt_logprobs)
                        if prompt_logprobs is not None
                        else None
                    ),
                    "prompt_token_ids": list(seq.prompt_ids) if token_ids else None,
                    "routed_experts": None,
                    "weight_versions": (
                        flight.weight_versions(len(s.token_ids))
                        if body.get("return_weight_versions")
                        else None
                    ),
                }
            )
        prompt_tokens = sum(len(seq.prompt_ids) for seq in seqs if seq.index % ctx.n == 0)
        completion_tokens = sum(len(seq.sample.token_ids) for seq in seqs)
        return json_response(
            {
                "id": ctx.request_id,
                "object": "text_completion",
                "created": ctx.created,
                "model": self.model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(prompt_tokens, completion_tokens),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    async def _completions_stream(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq]
    ) -> web.StreamResponse:
        body = ctx.body
        usage, continuous = _usage_flags(body)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        logprobs = body.get("logprobs")
        token_ids = bool(body.get("return_token_ids"))
        versions = bool(body.get("return_weight_versions"))
        sse = self._stream(ctx.request, self._spaced_error(generation_error()))
        await sse.open()
        offsets = {seq.index: 0 for seq in seqs}
        emitted = {seq.index: 0 for seq in seqs}
        longest = max(len(seq.sample.token_ids) for seq in seqs)
        async for step in self.steps(flight, longest):
            for seq in seqs:
                s = seq.sample
                if step >= len(s.token_ids):
                    continue
                finished = step == len(s.token_ids) - 1
                emitted[seq.index] = step + 1
                lp = None
                if logprobs is not None:
                    lp, offsets[seq.index] = self._completion_logprobs(
                        s, step, step + 1, logprobs, as_ids, offsets[seq.index]
                    )
                chunk = self._completion_chunk(
                    ctx,
                    seq,
                    text=s.deltas[step],
                    logprobs=lp,
                    finish=s.finish_reason if finished else None,
                    stop_reason=s.stop_reason if finished else None,
                    token_ids=[s.token_ids[step]] if token_ids else None,
                    first=step == 0 and token_ids,
                    versions=flight.weight_versions(step + 1) if versions and finished else None,
                    fingerprint=finished and not usage,
                    usage=self._short_usage(len(seq.prompt_ids), step + 1) if continuous else None,
                )
                if not await sse.send(dumps(chunk)):
                    return await sse.finish()
        for seq in seqs:  # aborted: close unfinished choices
            if emitted[seq.index] < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(emitted[seq.index])
                chunk = self._completion_chunk(
                    ctx,
                    seq,
                    text="",
                    logprobs=None,
                    finish="abort",
                    stop_reason=None,
                    token_ids=[] if token_ids else None,
                    first=emitted[seq.index] == 0 and token_ids,
                    versions=None,
                    fingerprint=not usage,
                    usage=None,
                )
                if not await sse.send(dumps(chunk)):
                    return await sse.finish()
        if usage:
            prompt_tokens = sum(len(seq.prompt_ids) for seq in seqs if seq.index % ctx.n == 0)
            completion = sum(len(seq.sample.token_ids) for seq in seqs)
            tail = {
                "id": ctx.request_id,
                "object": "text_completion",
                "created": ctx.created,
                "model": self.model,
                "choices": [],
                "usage": self._short_usage(prompt_tokens, completion),
                "system_fingerprint": self.system_fingerprint,
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    def _completion_chunk(
        self,
        ctx: _Ctx,
        seq: _Seq,
        *,
        text: str,
        logprobs: JSON | None,
        finish: str | None,
        stop_reason: int | str | None,
        token_ids: list[int] | None,
        first: bool,
        versions: list[JSON] | None,
        fingerprint: bool,
        usage: JSON | None,
    ) -> JSON:
        chunk: JSON = {
            "id": ctx.request_id,
            "object": "text_completion",
            "created": ctx.created,
            "model": self.model,
            "choices": [
                {
                    "index": seq.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "prompt_token_ids": list(seq.prompt_ids) if first else None,
                    "token_ids": token_ids,
                    "weight_versions": versions,
                }
            ],
        }
        if usage is not None:
            chunk["usage"] = usage
        if fingerprint and finish is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        chunk["kv_transfer_params"] = None
        return chunk

    # -- /v1/chat/completions -----------------------------------------------------------------

    def _chat_validate(self, body: JSON) -> None:
        tools = body.get("tools")
        if tools == []:
            raise validation_error(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                "tools",
            )
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if tool_choice not in (None, "none") and tools is None:
            raise validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if tool_choice not in (None, "none", "auto", "required") and not isinstance(
            tool_choice, dict
        ):
            raise validation_error(
                f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", '
                '"auto" or "required" are supported.',
                "tool_choice",
            )
        self._check_int_field(body, "top_logprobs")
        self._check_prompt_logprobs(body)
        top = body.get("top_logprobs")
        if top is not None:
            if top < 0 and top != -1:
                raise validation_error(
                    "`top_logprobs` must be a positive value or -1.", "top_logprobs", top
                )
            if (top == -1 or top > 0) and not body.get("logprobs"):
                raise validation_error(
                    "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
                )
        self._check_stream_options(body)
        if "messages" not in body:
            raise missing_fields_error(body, ["messages"])

    def _render(self, body: JSON, messages: Any, tools: Any) -> tuple[int, ...]:
        """Chat prompt ids; a template failure is a 400, as vLLM maps jinja errors."""
        try:
            _, ids = self.text.render_chat(
                messages,
                tools,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=bool(body.get("continue_final_message")),
                template_kwargs=body.get("chat_template_kwargs"),
            )
        except Exception as exc:
            raise VLLMError(str(exc), "BadRequestError", 400) from exc
        return ids

    def _parses_tools(self, body: JSON) -> bool:
        """Tool calls are extracted (auto tool choice on, tools given, tool_choice not none)."""
        tool_choice = body.get("tool_choice", "auto" if body.get("tools") else "none")
        return bool(self.tool_call_parser and body.get("tools") and tool_choice != "none")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await self._body(request)
            self._chat_validate(body)
            messages = body["messages"]
            tools = body.get("tools") or []
            prompt_ids = self._render(body, messages, tools)
            parses = self._parses_tools(body)
            max_tokens = body.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = body.get("max_tokens")
            params = self._params(body, len(prompt_ids), max_tokens, skip_special=not parses)
            tool_choice = body.get("tool_choice", "auto" if tools else "none")
            seqs = []
            for j in range(int(body.get("n") or 1)):
                seed = self.text.seed_for(prompt_ids, j, params)
                plan = self.text.plan_chat(messages, tools, tool_choice, seed)
                seqs.append(_Seq(j, prompt_ids, self.text.sample(plan, params, seed)))
            request_id = f"chatcmpl-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit([request_id])
        except VLLMError as exc:
            return exc.response()
        except Paused:
            if body.get("stream"):
                error = VLLMError(PAUSED_MESSAGE, "InternalServerError", 503)
                return await self._error_stream(request, dumps(error.body()))
            return paused_error().response()
        ctx = _Ctx(request, raw, body, request_id, self.created(), len(seqs))
        if body.get("stream"):
            return await self._run(
                request, flight, request_id, lambda: self._chat_stream(ctx, flight, seqs, parses)
            )
        return await self._run(
            request, flight, request_id, lambda: self._chat_full(ctx, flight, seqs, parses)
        )

    async def _error_stream(self, request: web.Request, event: bytes) -> web.StreamResponse:
        sse = SSEStream(request, keepalive=False, error_after=0, error_event=event)
        await sse.open()
        await sse.send(b"")
        return await sse.finish()

    def _tool_call_id(self, ctx: _Ctx, choice: int, call: int) -> str:
        return "chatcmpl-tool-" + self.new_id(ctx.raw, "tool", str(choice), str(call))

    async def _chat_full(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq], parses: bool
    ) -> web.StreamResponse:
        await self._final(flight, seqs)
        body = ctx.body
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        token_ids = bool(body.get("return_token_ids"))
        choices = []
        for seq in seqs:
            s = seq.sample
            content: str | None = s.text
            tool_calls: list[JSON] = []
            extracted = hermes_extract(s.text) if parses else None
            if extracted is not None:
                content = extracted[0]
                tool_calls = [
                    {
                        "id": self._tool_call_id(ctx, seq.index, k),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                    for k, (name, arguments) in enumerate(extracted[1])
                ]
            message: JSON = {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if tool_calls:
                message["tool_calls"] = tool_calls
            message["reasoning"] = None
            finish = s.finish_reason
            if tool_calls and finish == "stop" and not isinstance(body.get("tool_choice"), dict):
                finish = "tool_calls"
            lp = None
            if body.get("logprobs"):
                top = body.get("top_logprobs") or 0
                lp = self._chat_logprobs(s, 0, len(s.token_ids), top, as_ids)
            choices.append(
                {
                    "index": seq.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": s.stop_reason,
                    "token_ids": list(s.token_ids) if token_ids else None,
                    "routed_experts": None,
                    "weight_versions": (
                        flight.weight_versions(len(s.token_ids))
                        if body.get("return_weight_versions")
                        else None
                    ),
                }
            )
        prompt_ids = seqs[0].prompt_ids
        prompt_logprobs = body.get("prompt_logprobs")
        return json_response(
            {
                "id": ctx.request_id,
                "object": "chat.completion",
                "created": ctx.created,
                "model": self.model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(
                    len(prompt_ids), sum(len(seq.sample.token_ids) for seq in seqs)
                ),
                "prompt_logprobs": (
                    self._prompt_logprobs(prompt_ids, prompt_logprobs)
                    if prompt_logprobs is not None
                    else None
                ),
                "prompt_token_ids": list(prompt_ids) if token_ids else None,
                "prompt_text": (
                    self.text.decode(prompt_ids) if body.get("return_prompt_text") else None
                ),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    async def _chat_stream(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq], parses: bool
    ) -> web.StreamResponse:
        body = ctx.body
        usage, continuous = _usage_flags(body)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        token_ids = bool(body.get("return_token_ids"))
        versions = bool(body.get("return_weight_versions"))
        want_logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
        named = isinstance(body.get("tool_choice"), dict)
        prompt_ids = seqs[0].prompt_ids
        head: JSON = {
            "id": ctx.request_id,
            "object": "chat.completion.chunk",
            "created": ctx.created,
            "model": self.model,
        }
        error = VLLMError("Internal server error", "InternalServerError", 500)
        sse = self._stream(ctx.request, dumps(error.body()))
        await sse.open()
        parsers = {
            seq.index: HermesStream(partial(self._tool_call_id, ctx, seq.index)) for seq in seqs
        }
        emitted = {seq.index: 0 for seq in seqs}
        longest = max(len(seq.sample.token_ids) for seq in seqs)
        started = False
        async for step in self.steps(flight, longest):
            if not started:
                started = True
                for seq in seqs:
                    first = {
                        **head,
                        "choices": [
                            {
                                "index": seq.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if continuous:
                        first["usage"] = self._short_usage(len(prompt_ids), 0)
                    first["prompt_token_ids"] = list(prompt_ids) if token_ids else None
                    first["prompt_text"] = None
                    if not await sse.send(dumps(first)):
                        return await sse.finish()
            for seq in seqs:
                s = seq.sample
                if step >= len(s.token_ids):
                    continue
                emitted[seq.index] = step + 1
                finished = step == len(s.token_ids) - 1
                lp = self._chat_logprobs(s, step, step + 1, top, as_ids) if want_logprobs else None
                parser = parsers[seq.index]
                delta: JSON | None
                if parses:
                    parsed = parser.feed("".join(s.deltas[: step + 1]))
                    if parsed is None:
                        delta = None
                    else:
                        delta = {"content": parsed[0]}
                        if parsed[1]:
                            delta["tool_calls"] = parsed[1]
                elif self.tool_call_parser:  # parser on, tool_choice "none": text passes through
                    delta = {"content": s.deltas[step]} if s.deltas[step] else None
                else:
                    delta = {"content": s.deltas[step]}
                if delta is None:
                    if not finished and lp is None and not token_ids:
                        continue
                    delta = {}
                finish = None
                if finished:
                    finish = s.finish_reason
                    if parser.tools_streamed and finish == "stop" and not named:
                        finish = "tool_calls"
                chunk = self._chat_chunk(
                    head,
                    seq.index,
                    delta,
                    lp,
                    finish,
                    s.stop_reason,
                    [s.token_ids[step]] if token_ids else None,
                    flight.weight_versions(step + 1) if versions and finished else None,
                    fingerprint=finished and not usage,
                    usage=(self._short_usage(len(prompt_ids), step + 1) if continuous else None),
                )
                if not await sse.send(dumps(chunk)):
                    return await sse.finish()
        for seq in seqs:  # aborted: close unfinished choices
            if emitted[seq.index] < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(emitted[seq.index])
                chunk = self._chat_chunk(
                    head,
                    seq.index,
                    {},
                    None,
                    "abort",
                    None,
                    [] if token_ids else None,
                    None,
                    fingerprint=not usage,
                    usage=None,
                )
                if not await sse.send(dumps(chunk)):
                    return await sse.finish()
        if usage:
            completion = sum(len(seq.sample.token_ids) for seq in seqs)
            tail = {
                **head,
                "choices": [],
                "usage": self._short_usage(len(prompt_ids), completion),
                "system_fingerprint": self.system_fingerprint,
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    def _chat_chunk(
        self,
        head: JSON,
        index: int,
        delta: JSON,
        logprobs: JSON | None,
        finish: str | None,
        stop_reason: int | str | None,
        token_ids: list[int] | None,
        versions: list[JSON] | None,
        *,
        fingerprint: bool,
        usage: JSON | None,
    ) -> JSON:
        choice: JSON = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = token_ids
        if finish is not None:
            choice["weight_versions"] = versions
        chunk: JSON = {**head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        if fingerprint and finish is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        chunk["kv_transfer_params"] = None
        return chunk

    # -- /inference/v1/generate ---------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await self._body(request)
            missing = [f for f in ("token_ids", "sampling_params") if f not in body]
            if missing:
                raise missing_fields_error(body, missing)
            prompt_ids = tuple(body["token_ids"])
            sp = body["sampling_params"] or {}
            self._check_stream_options(body)
            mode = body.get("output_mode", "tokens")
            if mode not in ("tokens", "text"):
                raise VLLMError(f"output_mode={mode!r} is not simulated", "BadRequestError", 400)
            params = self._params({**sp}, len(prompt_ids), sp.get("max_tokens"))
            seqs = [
                _Seq(j, prompt_ids, self._sample(prompt_ids, j, params))
                for j in range(int(sp.get("n") or 1))
            ]
            request_id = f"generate-tokens-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit([request_id])
        except VLLMError as exc:
            return exc.response()
        except Paused:
            if body.get("stream"):
                return await self._error_stream(request, self._spaced_error(paused_error()))
            return paused_error().response()
        ctx = _Ctx(request, raw, body, request_id, self.created(), len(seqs))
        if body.get("stream"):
            return await self._run(
                request, flight, request_id, lambda: self._generate_stream(ctx, flight, seqs)
            )
        return await self._run(
            request, flight, request_id, lambda: self._generate_full(ctx, flight, seqs)
        )

    def _generate_choice(
        self, ctx: _Ctx, seq: _Seq, start: int, end: int, finish: str | None, versions: Any
    ) -> JSON:
        s = seq.sample
        count = ctx.body["sampling_params"].get("logprobs")
        text_mode = ctx.body.get("output_mode") == "text"
        choice: JSON = {
            "index": seq.index,
            "finish_reason": finish,
            "stop_reason": s.stop_reason if finish not in (None, "abort") else None,
            "token_ids": list(s.token_ids[start:end]),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": versions,
        }
        if text_mode:
            choice["text"] = "".join(s.deltas[start:end])
        logprobs = None
        if count is not None:
            if text_mode:
                logprobs = self._chat_logprobs(s, start, end, max(count, 1), False)
            else:
                logprobs = self._generate_logprobs(s, start, end, count)
        choice["logprobs"] = logprobs
        return choice

    async def _generate_full(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq]
    ) -> web.StreamResponse:
        await self._final(flight, seqs)
        prompt_ids = seqs[0].prompt_ids
        choices = [
            self._generate_choice(
                ctx,
                seq,
                0,
                len(seq.sample.token_ids),
                seq.sample.finish_reason,
                flight.weight_versions(len(seq.sample.token_ids)),
            )
            for seq in seqs
        ]
        return json_response(
            {
                "request_id": ctx.request_id,
                "model": self.model,
                "created": ctx.created,
                "usage": self._usage(len(prompt_ids), sum(len(s.sample.token_ids) for s in seqs)),
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": (
                    list(prompt_ids) if ctx.body.get("return_token_ids") else None
                ),
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": ctx.body.get("output_mode", "tokens"),
                "choices": choices,
            }
        )

    async def _generate_stream(
        self, ctx: _Ctx, flight: Flight, seqs: list[_Seq]
    ) -> web.StreamResponse:
        usage, continuous = _usage_flags(ctx.body)
        mode = ctx.body.get("output_mode", "tokens")
        prompt_ids = seqs[0].prompt_ids
        pending_prompt = bool(ctx.body.get("return_token_ids"))
        sse = self._stream(ctx.request, self._spaced_error(generation_error()))
        await sse.open()
        emitted = {seq.index: 0 for seq in seqs}
        longest = max(len(seq.sample.token_ids) for seq in seqs)

        def chunk(choice: JSON, generated: int) -> bytes:
            nonlocal pending_prompt
            out: JSON = {"request_id": ctx.request_id, "usage": None}
            if pending_prompt:
                out["prompt_token_ids"] = list(prompt_ids)
                pending_prompt = False
            if continuous:
                out["usage"] = self._short_usage(len(prompt_ids), generated)
            out["output_mode"] = mode
            out["choices"] = [choice]
            return dumps(out)

        async for step in self.steps(flight, longest):
            for seq in seqs:
                s = seq.sample
                if step >= len(s.token_ids):
                    continue
                emitted[seq.index] = step + 1
                finished = step == len(s.token_ids) - 1
                choice = self._generate_choice(
                    ctx,
                    seq,
                    step,
                    step + 1,
                    s.finish_reason if finished else None,
                    flight.weight_versions(step + 1) if finished else None,
                )
                if not await sse.send(chunk(choice, step + 1)):
                    return await sse.finish()
        for seq in seqs:
            if emitted[seq.index] < len(seq.sample.token_ids):
                seq.sample = seq.sample.prefix(emitted[seq.index])
                n = emitted[seq.index]
                choice = self._generate_choice(ctx, seq, n, n, "abort", flight.weight_versions(n))
                if not await sse.send(chunk(choice, n)):
                    return await sse.finish()
        if usage:
            completion = sum(len(seq.sample.token_ids) for seq in seqs)
            tail = {
                "request_id": ctx.request_id,
                "usage": self._short_usage(len(prompt_ids), completion),
                "output_mode": mode,
                "choices": [],
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    # -- small routes -------------------------------------------------------------------------

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
            _, body = await self._body(request)
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
            _, body = await self._body(request)
            if "tokens" not in body:
                raise missing_fields_error(body, ["tokens"])
        except VLLMError as exc:
            return exc.response()
        return json_response({"prompt": self.text.decode(body["tokens"])})

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
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            self.engine.weight_version = str(version)
        return json_response({"message": "Weight update finished"})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        try:
            _, body = await self._body(request)
            if "new_version" not in body:
                raise missing_fields_error(body, ["new_version"])
        except VLLMError as exc:
            return exc.response()
        self.engine.weight_version = str(body["new_version"])
        return json_response({"success": True, "new_version": body["new_version"]})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})


@dataclass
class _Ctx:
    """Per-request values the response builders need."""

    request: web.Request
    raw: bytes
    body: JSON
    request_id: str
    created: int
    n: int  # choices per prompt


def _usage_flags(body: JSON) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from `stream_options`."""
    options = body.get("stream_options") or {}
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DONE",
    "EVENT_STREAM",
    "FIXED_CREATED",
    "JSON",
    "KEEPALIVE",
    "PAUSED_MESSAGE",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "VLLM_VERSION",
    "AbortLog",
    "Engine",
    "Flight",
    "HermesStream",
    "Paused",
    "RecordedRequest",
    "SSEStream",
    "Sample",
    "SampleParams",
    "SimulatedServer",
    "SimulatedVLLM",
    "TextModel",
    "VLLMError",
    "ascii_text",
    "dumps",
    "generation_error",
    "hermes_extract",
    "hex_digest",
    "json_response",
    "message_text",
    "missing_fields_error",
    "parse_chatml",
    "paused_error",
    "random_uuid",
    "start_app",
    "tool_rounds",
    "validation_error",
]
