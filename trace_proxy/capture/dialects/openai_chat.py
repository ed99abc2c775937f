"""OpenAI chat completions as vLLM and SGLang serve them (`POST /v1/chat/completions`).

vLLM puts `prompt_token_ids` at the top level and `token_ids` in each choice; SGLang puts
`prompt_token_ids` / `response_token_ids` in each choice and reports `matched_stop`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trace_proxy.capture.dialects.common import (
    ChoiceStream,
    ParsedCall,
    ParseError,
    as_int_list,
    as_list,
    as_object,
    chosen_logprobs,
    fill_response,
    ids_from_logprob_tokens,
    index_of,
    new_call,
    normalize_tool_calls,
    stream_error,
    stream_events,
    text_of,
    unparsed_response,
    usage_of,
    weight_version_of,
)
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.dialects import OPENAI_CHAT
from trace_proxy.trajectories.record import GenerateCall, Output

DIALECT = OPENAI_CHAT  # its name, routes and prompt ids field: trajectories/dialects.py


def parse(ex: Exchange, request: Mapping[str, Any]) -> list[ParsedCall]:
    messages = request.get("messages")
    if not isinstance(messages, list):
        raise ParseError("request has no 'messages' list")
    call = new_call(ex, DIALECT.name, request)
    call.prompt.messages = messages
    call.prompt.tools = request.get("tools") or None
    try:
        body = fill_response(call, ex)
        if body is not None:
            _from_response(call, body)
        elif ex.is_event_stream and ex.status is not None and ex.status < 400:
            _from_stream(call, ex)
    except ParseError as exc:
        unparsed_response([call], exc)
    return [ParsedCall(call, request)]


def _from_response(call: GenerateCall, body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ParseError("response has no 'choices' list")
    call.request_id = text_of(body.get("id"))
    call.model = text_of(body.get("model")) or call.model
    call.usage = usage_of(body.get("usage"))
    call.prompt.token_ids = as_int_list(body.get("prompt_token_ids"))
    for item in body["choices"]:
        choice = as_object(item, "a choice")
        message = as_object(choice.get("message"), "a choice's message")
        if call.prompt.token_ids is None:
            call.prompt.token_ids = as_int_list(choice.get("prompt_token_ids"))
        call.outputs.append(
            Output(
                index=index_of(choice, "choice"),
                text=text_of(message.get("content")),
                token_ids=as_int_list(choice.get("token_ids"))
                or as_int_list(choice.get("response_token_ids"))
                or ids_from_logprob_tokens(choice.get("logprobs")),
                logprobs=chosen_logprobs(choice.get("logprobs")),
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason", choice.get("matched_stop")),
                tool_calls=normalize_tool_calls(message.get("tool_calls")),
                reasoning=text_of(message.get("reasoning"))
                or text_of(message.get("reasoning_content")),
            )
        )
        call.weight_version = call.weight_version or weight_version_of(choice)


def _from_stream(call: GenerateCall, ex: Exchange) -> None:
    merged = ChoiceStream()
    for event in stream_events(ex):
        if "error" in event and "choices" not in event:
            call.error = stream_error(event)
            continue
        call.request_id = call.request_id or text_of(event.get("id"))
        call.model = text_of(event.get("model")) or call.model
        if call.prompt.token_ids is None:
            call.prompt.token_ids = as_int_list(event.get("prompt_token_ids"))
        if usage := usage_of(event.get("usage")):
            call.usage = usage
        for item in as_list(event.get("choices"), "an event's choices"):
            choice = as_object(item, "a choice")
            delta = as_object(choice.get("delta"), "a choice's delta")
            merged.add(
                choice,
                delta.get("content"),
                delta.get("reasoning") or delta.get("reasoning_content"),
            )
            merged.add_tool_fragments(
                index_of(choice, "choice"), as_list(delta.get("tool_calls"), "tool calls")
            )
            call.weight_version = call.weight_version or weight_version_of(choice)
    call.outputs = merged.outputs()
    if call.prompt.token_ids is None and merged.prompt_token_ids:
        call.prompt.token_ids = merged.prompt_token_ids[min(merged.prompt_token_ids)]
