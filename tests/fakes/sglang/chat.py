"""SGLang's OpenAI-compatible `/v1/chat/completions`, whole and streamed, with tool calls.

Follows sglang 0.5.23 `srt/entrypoints/openai/serving_chat.py`, with tool calls parsed as its
`qwen25` detector does (`srt/function_call/qwen25_detector.py`): the rid as `id`,
`reasoning_content` always present, content never null, a call streamed as its name and then
its arguments, `finish_reason` `tool_calls` once a call was made, `prompt_token_ids` and
`response_token_ids` on a whole answer only (a stream that asks for them is refused).

Refusals are JSON 400s: FastAPI's validation of `ChatCompletionRequest`, `_validate_request`'s
texts (`BadRequestError`), the `ValueError`s of `_convert_to_internal_request` (`BadRequest`,
from `handle_request`) and the manager's length checks (`BadRequestError`, before a stream's
200 too). A stream cut by `/abort_request` ends each unfinished choice with `finish_reason`
`"abort"` (`_generate_chat_stream`: a graceful abort is an ordinary finish reason, never turned
into `tool_calls`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    JSON,
    Flight,
    Sample,
    dumps,
    hermes_extract,
    json_response,
)

from .base import SGLangBase


class ChatRoutes(SGLangBase):
    """`/v1/chat/completions`: the chat template, `n` choices, qwen25 tool calls."""

    def _tool_call_id(self, raw: bytes, choice: int, call: int) -> str:
        return "call_" + self.new_id(raw, "call", str(choice), str(call), size=12)

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = self._openai_body(request, raw, "messages")
        if isinstance(body, web.Response):
            return body
        stream = bool(body.get("stream"))
        messages, tools = body["messages"], body.get("tools") or []
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        invalid = self._invalid_chat(messages, tools, tool_choice)
        if invalid is not None:
            return self._openai_error(invalid)
        if stream and body.get("return_prompt_token_ids"):
            return self._openai_error(
                "return_prompt_token_ids is not supported with streaming. Please set "
                "stream=false when using return_prompt_token_ids=true.",
                err_type="BadRequest",
            )
        if stream and body.get("return_token_ids"):
            return self._openai_error(
                "return_token_ids is not supported with streaming on /v1/chat/completions. "
                "Please set stream=false when using return_token_ids=true.",
                err_type="BadRequest",
            )
        parses = bool(self.tool_call_parser and tools and tool_choice != "none")
        _, prompt_ids = self.text.render_chat(
            messages, tools, template_kwargs=body.get("chat_template_kwargs")
        )
        try:
            self._check_length(len(prompt_ids), self._openai_max_tokens(body, None))
        except ValueError as exc:
            return self._openai_error(str(exc))
        refusal = self._scheduler_refusal(len(prompt_ids))
        if refusal is not None and not stream:
            return self._openai_error(refusal)
        params = self._openai_params(body, len(prompt_ids), None, skip_special=not parses)
        samples = []
        for j in range(int(body.get("n") or 1)):
            seed = self.text.seed_for(prompt_ids, j, params)
            plan = self.text.plan_chat(messages, tools, tool_choice, seed)
            samples.append(self.text.sample(plan, params, seed))
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) else self.new_id(raw, "rid", size=16)
        flight = self.engine.admit([rid])
        created = self.created()
        model = body.get("model", "default")

        async def run() -> web.StreamResponse:
            if stream and refusal is not None:
                return await self._refused_chat_stream(request, body, rid, model, refusal)
            if stream:
                return await self._chat_stream(
                    request, body, raw, rid, model, created, samples, parses, flight, prompt_ids
                )
            longest = max(len(s.token_ids) for s in samples)
            steps = await self.engine.run(flight, longest)
            samples[:] = [s if steps >= len(s.token_ids) else s.prefix(steps) for s in samples]
            choices = []
            for i, s in enumerate(samples):
                content, calls = self._parse_calls(s.text, parses, raw, i)
                message: JSON = {"role": "assistant", "content": content or ""}
                message["reasoning_content"] = None
                if calls:
                    message["tool_calls"] = calls
                finish = "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason
                choice: JSON = {
                    "index": i,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": None if calls else self._matched_stop(s),
                }
                if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
                    choice["prompt_token_ids"] = list(prompt_ids)
                if body.get("return_token_ids"):
                    choice["response_token_ids"] = list(s.token_ids)
                choices.append(choice)
            completion = sum(len(s.token_ids) for s in samples)
            return json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": choices,
                    "usage": self._usage(len(prompt_ids), completion),
                    "metadata": self._metadata(flight, len(samples[0].token_ids)),
                }
            )

        return await self._run(flight, [rid], run)

    @staticmethod
    def _invalid_chat(messages: Any, tools: list[JSON], tool_choice: Any) -> str | None:
        """`OpenAIServingChat._validate_request`: the checks a client can trip here."""
        if not messages:
            return "Messages cannot be empty."
        if isinstance(tool_choice, str) and tool_choice.lower() == "required" and not tools:
            return "Tools cannot be empty if tool choice is set to required."
        if isinstance(tool_choice, dict):
            if not tools:
                return "Tools cannot be empty if tool choice is set to a specific tool."
            name = (tool_choice.get("function") or {}).get("name")
            if all((tool.get("function") or {}).get("name") != name for tool in tools):
                return f"Tool '{name}' not found in tools list."
        return None

    async def _refused_chat_stream(
        self, request: web.Request, body: JSON, rid: str, model: str, refusal: str
    ) -> web.StreamResponse:
        """A prompt the scheduler refused, streamed: its error event, the usage chunk when
        asked for (the one token the refused request kept), `[DONE]`."""
        sse = self._openai_stream(request)
        await sse.open()
        if not await sse.send(self._refused_event(refusal)):
            return await sse.finish()
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": self.created(),
                "model": model,
                "choices": [],
                "usage": self._usage(1, 0),
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()

    def _parse_calls(
        self, text: str, parses: bool, raw: bytes, choice: int
    ) -> tuple[str | None, list[JSON]]:
        """(content, tool_calls) as SGLang's qwen25 detector returns them."""
        extracted = hermes_extract(text) if parses else None
        if extracted is None:
            return text, []
        content, calls = extracted
        return content, [
            {
                "id": self._tool_call_id(raw, choice, k),
                "index": k,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for k, (name, arguments) in enumerate(calls)
        ]

    async def _chat_stream(
        self,
        request: web.Request,
        body: JSON,
        raw: bytes,
        rid: str,
        model: str,
        created: int,
        samples: list[Sample],
        parses: bool,
        flight: Flight,
        prompt_ids: tuple[int, ...],
    ) -> web.StreamResponse:
        sse = self._openai_stream(request)
        await sse.open()
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        def simple(index: int, delta: JSON, finish: str | None, matched: Any) -> bytes:
            """`build_sse_content`: msgspec, `reasoning_content` always, role/content if set."""
            choice = {
                "index": index,
                "delta": {"reasoning_content": None, **delta},
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
            return dumps({**head, "choices": [choice]})

        longest = max(len(s.token_ids) for s in samples)
        tool_sent = [False] * len(samples)
        done = 0
        async for step in self.steps(flight, longest):
            done = step + 1
            for i, s in enumerate(samples):
                if step == 0 and not await sse.send(
                    simple(i, {"role": "assistant", "content": ""}, None, None)
                ):
                    return await sse.finish()
                if step >= len(s.token_ids):
                    continue
                text = "".join(s.deltas[: step + 1])
                in_call = parses and "<tool_call>" in text
                if in_call:
                    _, calls = self._parse_calls(text, parses, raw, i)
                    if calls and not tool_sent[i]:
                        tool_sent[i] = True
                        for call in calls:
                            for fn in (
                                {"name": call["function"]["name"], "arguments": ""},
                                {"name": None, "arguments": call["function"]["arguments"]},
                            ):
                                tool_call = {
                                    "id": call["id"] if fn["name"] else None,
                                    "index": call["index"],
                                    "type": "function",
                                    "function": fn,
                                }
                                delta = {
                                    "role": None,
                                    "content": None,
                                    "reasoning_content": None,
                                    "tool_calls": [tool_call],
                                }
                                chunk = {
                                    **head,
                                    "choices": [
                                        {
                                            "index": i,
                                            "delta": delta,
                                            "logprobs": None,
                                            "finish_reason": None,
                                            "matched_stop": None,
                                        }
                                    ],
                                    "usage": None,
                                }
                                if not await sse.send(dumps(chunk)):
                                    return await sse.finish()
                elif s.deltas[step] and not await sse.send(
                    simple(i, {"content": s.deltas[step]}, None, None)
                ):
                    return await sse.finish()
        for i, s in enumerate(samples):
            if done < len(s.token_ids):  # aborted: the choice ends as SGLang reports it
                samples[i] = s = s.prefix(done)
                opening = {"role": "assistant", "content": ""}
                if done == 0 and not await sse.send(simple(i, opening, None, None)):
                    return await sse.finish()
            finish = "tool_calls" if tool_sent[i] and s.finish_reason == "stop" else s.finish_reason
            matched = None if tool_sent[i] else self._matched_stop(s)
            if not await sse.send(simple(i, {}, finish, matched)):
                return await sse.finish()
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = {
                **head,
                "choices": [],
                "usage": self._usage(len(prompt_ids), sum(len(s.token_ids) for s in samples)),
            }
            if not await sse.send(dumps(tail)):
                return await sse.finish()
        return await sse.finish()
