"""vLLM's token-in/token-out route (`POST /inference/v1/generate`), used by SkyRL.

Request `token_ids` + `sampling_params`; response `choices[].token_ids`, top-level
`prompt_token_ids`; streamed as per-chunk token deltas with the prompt in the first chunk.
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
    as_prompt_ids,
    chosen_logprobs,
    fill_response,
    index_of,
    new_call,
    stream_error,
    stream_events,
    text_of,
    unparsed_response,
    usage_of,
    weight_version_of,
)
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.dialects import VLLM_GENERATE
from trace_proxy.trajectories.record import GenerateCall, Output

DIALECT = VLLM_GENERATE  # its name, routes and prompt ids field: trajectories/dialects.py


def parse(ex: Exchange, request: Mapping[str, Any]) -> list[ParsedCall]:
    token_ids = as_prompt_ids(request.get("token_ids"))
    if token_ids is None:
        raise ParseError("request has no 'token_ids' list")
    call = new_call(ex, DIALECT.name, request)
    params = request.get("sampling_params")
    if isinstance(params, dict):
        call.sampling.update(params)
    call.prompt.token_ids = token_ids
    try:
        _fill(call, ex)
    except ParseError as exc:
        unparsed_response([call], exc)
    return [ParsedCall(call, request)]


def _fill(call: GenerateCall, ex: Exchange) -> None:
    body = fill_response(call, ex, skip_prompt_echo=True)
    if body is not None:
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise ParseError("response has no 'choices' list")
        call.request_id = text_of(body.get("request_id"))
        call.model = text_of(body.get("model")) or call.model
        call.usage = usage_of(body.get("usage"))
        for item in body["choices"]:
            choice = as_object(item, "a choice")
            call.outputs.append(
                Output(
                    index=index_of(choice, "choice"),
                    token_ids=as_int_list(choice.get("token_ids")),
                    logprobs=chosen_logprobs(choice.get("logprobs")),
                    finish_reason=choice.get("finish_reason"),
                    stop_reason=choice.get("stop_reason"),
                )
            )
            call.weight_version = weight_version_of(choice) or call.weight_version
    elif ex.is_event_stream and ex.status is not None and ex.status < 400:
        merged = ChoiceStream()
        for event in stream_events(ex, skip_prompt_echo=True):
            if "error" in event and "choices" not in event:
                call.error = stream_error(event)
                continue
            call.request_id = call.request_id or text_of(event.get("request_id"))
            call.model = text_of(event.get("model")) or call.model
            if usage := usage_of(event.get("usage")):
                call.usage = usage
            for item in as_list(event.get("choices"), "an event's choices"):
                choice = as_object(item, "a choice")
                merged.add(choice, None)
                call.weight_version = weight_version_of(choice) or call.weight_version
        call.outputs = merged.outputs()
