"""`/v1/chat/completions`, following vLLM 0.33's `vllm/entrypoints/openai/chat_completion`.

Prompts rendered with the tokenizer's chat template, tool calls extracted as with
`--enable-auto-tool-choice --tool-call-parser hermes`, `ChatCompletionLogProbs`, and the
streaming chunks in vLLM's order: the role chunk first, content or tool-call deltas, the finish.
"""

from __future__ import annotations

from functools import partial

from aiohttp import web

from .base import Ctx, Seq, VLLMBase
from .engine import PAUSED_MESSAGE, Flight, Paused
from .errors import VLLMError, missing_fields_error, validation_error
from .hermes import HermesStream, hermes_extract
from .logprobs import chat_logprobs, prompt_logprobs
from .model import Sample
from .parsing import (
    check_int_field,
    check_prompt_logprobs,
    check_stream_options,
    read_body,
    usage_flags,
)
from .wire import JSON, dumps, json_response


class ChatRoutes(VLLMBase):
    """The chat route: a conversation rendered, sampled, tool calls parsed, whole or streamed."""

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
        check_int_field(body, "top_logprobs")
        check_prompt_logprobs(body)
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
        check_stream_options(body)
        if "messages" not in body:
            raise missing_fields_error(body, ["messages"])

    def _parses_tools(self, body: JSON) -> bool:
        """Tool calls are extracted (auto tool choice on, tools given, tool_choice not none)."""
        tool_choice = body.get("tool_choice", "auto" if body.get("tools") else "none")
        return bool(self.tool_call_parser and body.get("tools") and tool_choice != "none")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await read_body(request)
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
                seqs.append(Seq(j, prompt_ids, self.text.sample(plan, params, seed)))
            request_id = f"chatcmpl-{self._request_base_id(request, body, raw)}"
            flight = self.engine.admit([request_id])
        except VLLMError as exc:
            return exc.response()
        except Paused:
            error = VLLMError(PAUSED_MESSAGE, "InternalServerError", 503)
            return await self._refuse_paused(request, body, dumps(error.body()))
        ctx = Ctx(request, raw, body, request_id, self.created(), len(seqs))
        return await self._respond(
            ctx,
            flight,
            lambda: self._chat_stream(ctx, flight, seqs, parses),
            lambda: self._chat_full(ctx, flight, seqs, parses),
        )

    def _tool_call_id(self, ctx: Ctx, choice: int, call: int) -> str:
        return "chatcmpl-tool-" + self.new_id(ctx.raw, "tool", str(choice), str(call))

    async def _chat_full(
        self, ctx: Ctx, flight: Flight, seqs: list[Seq], parses: bool
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
                lp = chat_logprobs(self.text, s, 0, len(s.token_ids), top, as_ids)
            choices.append(
                {
                    "index": seq.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": s.stop_reason,
                    "token_ids": list(s.token_ids) if token_ids else None,
                    "routed_experts": None,
                    "weight_versions": self._asked_versions(body, flight, len(s.token_ids)),
                }
            )
        prompt_ids = seqs[0].prompt_ids
        prompt_count = body.get("prompt_logprobs")
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
                    prompt_logprobs(self.text, prompt_ids, prompt_count)
                    if prompt_count is not None
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
        self, ctx: Ctx, flight: Flight, seqs: list[Seq], parses: bool
    ) -> web.StreamResponse:
        body = ctx.body
        usage, continuous = usage_flags(body)
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
        opening = [
            dumps(self._role_chunk(head, seq.index, prompt_ids, continuous, token_ids))
            for seq in seqs
        ]

        def token(seq: Seq, step: int, finished: bool) -> bytes | None:
            s = seq.sample
            lp = None
            if want_logprobs:
                lp = chat_logprobs(self.text, s, step, step + 1, top, as_ids)
            parser = parsers[seq.index]
            delta = self._chat_delta(parser if parses else None, s, step)
            if delta is None:
                if not finished and lp is None and not token_ids:
                    return None
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
            return dumps(chunk)

        def closing(seq: Seq, emitted: int) -> bytes:
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
            return dumps(chunk)

        def tail(completion: int) -> bytes:
            return dumps(
                {
                    **head,
                    "choices": [],
                    "usage": self._short_usage(len(prompt_ids), completion),
                    "system_fingerprint": self.system_fingerprint,
                }
            )

        return await self._emit(sse, flight, seqs, token, closing, tail if usage else None, opening)

    def _role_chunk(
        self, head: JSON, index: int, prompt_ids: tuple[int, ...], continuous: bool, token_ids: bool
    ) -> JSON:
        """The first chunk of a choice: the assistant role and empty content."""
        first: JSON = {
            **head,
            "choices": [
                {
                    "index": index,
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
        return first

    def _chat_delta(self, parser: HermesStream | None, s: Sample, step: int) -> JSON | None:
        """The delta for token `step`: tool-call deltas when parsing, else the token's text."""
        delta: JSON | None
        if parser is not None:
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
        return delta

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
        return self._chunk_end(chunk, usage, fingerprint and finish is not None)
