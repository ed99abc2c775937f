"""OpenAI completions as vLLM and SGLang serve them (`POST /v1/completions`).

`prompt` is a string, token ids, or a batch of either; choice `index` is prompt * n + sample,
so a batch becomes one call per prompt, each with its n outputs.
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
    ids_from_logprob_tokens,
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
from trace_proxy.trajectories.dialects import OPENAI_COMPLETIONS
from trace_proxy.trajectories.record import GenerateCall, Output, Prompt

DIALECT = OPENAI_COMPLETIONS  # its name, routes and prompt ids field: trajectories/dialects.py


def _prompts(request: Mapping[str, Any]) -> list[Prompt]:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    ids = as_prompt_ids(prompt)
    if ids is not None and prompt:
        return [Prompt(token_ids=ids)]
    if isinstance(prompt, list) and prompt:
        batch = []
        for item in prompt:
            if isinstance(item, str):
                batch.append(Prompt(text=item))
            elif (item_ids := as_int_list(item)) is not None:
                batch.append(Prompt(token_ids=item_ids))
            else:
                raise ParseError("'prompt' batch items must be strings or token-id lists")
        return batch
    raise ParseError("request has no usable 'prompt'")


def parse(ex: Exchange, request: Mapping[str, Any]) -> list[ParsedCall]:
    prompts = _prompts(request)
    n_requested = request.get("n")
    n = n_requested if isinstance(n_requested, int) and n_requested > 0 else 1
    calls = []
    for prompt in prompts:
        call = new_call(ex, DIALECT.name, request)
        call.prompt = prompt
        calls.append(call)
    try:
        _fill(calls, ex, n)
    except ParseError as exc:
        unparsed_response(calls, exc)
    return [ParsedCall(call, request) for call in calls]


def _fill(calls: list[GenerateCall], ex: Exchange, n: int) -> None:
    """Outputs from the response: choice `index` is prompt * n + sample."""
    has_ids = all(call.prompt.token_ids is not None for call in calls)
    body = fill_response(calls[0], ex, skip_prompt_echo=has_ids)
    for call in calls[1:]:
        call.error = calls[0].error
    outputs: list[Output] = []
    prompt_ids: dict[int, Any] = {}  # as received; validated where used
    versions: dict[int, str | None] = {}
    if body is not None:
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise ParseError("response has no 'choices' list")
        for call in calls:
            call.request_id = text_of(body.get("id"))
            call.model = text_of(body.get("model")) or call.model
            call.usage = usage_of(body.get("usage")) if len(calls) == 1 else None
        for item in body["choices"]:
            choice = as_object(item, "a choice")
            index = index_of(choice, "choice")
            outputs.append(
                Output(
                    index=index,
                    text=text_of(choice.get("text")),
                    token_ids=as_int_list(choice.get("token_ids"))
                    or ids_from_logprob_tokens(choice.get("logprobs")),
                    logprobs=chosen_logprobs(choice.get("logprobs")),
                    finish_reason=choice.get("finish_reason"),
                    stop_reason=choice.get("stop_reason", choice.get("matched_stop")),
                )
            )
            if (ids := choice.get("prompt_token_ids")) is not None:
                prompt_ids[index] = ids  # checked below, only where the request had no ids
            versions[index // n] = weight_version_of(choice) or versions.get(index // n)
    elif ex.is_event_stream and ex.status is not None and ex.status < 400:
        merged = ChoiceStream()
        for event in stream_events(ex, skip_prompt_echo=has_ids):
            if "error" in event and "choices" not in event:
                for call in calls:
                    call.error = stream_error(event)
                continue
            for call in calls:
                call.request_id = call.request_id or text_of(event.get("id"))
                call.model = text_of(event.get("model")) or call.model
                if (usage := usage_of(event.get("usage"))) and len(calls) == 1:
                    call.usage = usage
            for item in as_list(event.get("choices"), "an event's choices"):
                choice = as_object(item, "a choice")
                merged.add(choice, choice.get("text"))
                owner = index_of(choice, "choice") // n
                versions[owner] = weight_version_of(choice) or versions.get(owner)
        outputs = merged.outputs()
        prompt_ids = merged.prompt_token_ids
    for output in outputs:
        owner, sample = divmod(output.index, n)
        if owner < len(calls):
            output.index = sample
            calls[owner].outputs.append(output)
    for index, ids in prompt_ids.items():
        owner = index // n
        if owner < len(calls) and calls[owner].prompt.token_ids is None:
            calls[owner].prompt.token_ids = as_int_list(ids)
    for owner, version in versions.items():
        if owner < len(calls) and version is not None:
            calls[owner].weight_version = version
