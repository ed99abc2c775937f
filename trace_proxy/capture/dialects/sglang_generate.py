"""SGLang's native route (`POST|PUT /generate`), used by slime and AReaL.

A request holds one prompt (`text` or `input_ids`) or a batch; with a batch or `n` > 1 the
non-streamed answer is a JSON list, one object per prompt x sample, and streamed chunks carry
`index`. Streams are cumulative by default (each chunk repeats all text and ids so far) and
incremental with `--incremental-streaming-output`; `meta_info.completion_tokens` tells which.
A sequence the server refused after its stream began (the scheduler's prompt-length check, a
timeout) ends with an abort that carries an HTTP status: that call failed, with the server's
message; an abort without one (`/abort_request`, a pause) is a finish reason only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trace_proxy.capture.dialects.common import (
    MAX_ERROR_MESSAGE,
    ParsedCall,
    ParseError,
    as_int_list,
    as_object,
    as_prompt_ids,
    fill_response,
    index_of,
    new_call,
    stream_error,
    stream_events,
    text_of,
    unparsed_response,
)
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.dialects import SGLANG_GENERATE
from trace_proxy.trajectories.record import CallError, Output, Prompt

DIALECT = SGLANG_GENERATE  # its name, routes and prompt ids field: trajectories/dialects.py


def _prompts(request: Mapping[str, Any]) -> list[Prompt]:
    ids = request.get("input_ids")
    if ids is not None:
        if (single := as_prompt_ids(ids)) is not None and ids:
            return [Prompt(token_ids=single)]
        if isinstance(ids, list) and ids and all(as_int_list(i) is not None for i in ids):
            return [Prompt(token_ids=i) for i in ids]
        raise ParseError("'input_ids' must be token ids or a batch of them")
    text = request.get("text")
    if isinstance(text, str):
        return [Prompt(text=text)]
    if text == []:  # SGLang answers `[]`: nothing was generated
        raise ParseError("'text' is an empty batch: no prompt to generate from")
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        return [Prompt(text=t) for t in text]
    raise ParseError("request has neither 'text' nor 'input_ids'")


def _item(value: Any, i: int) -> Any:
    """Prompt i's entry of a per-prompt list (None past its end), or the one shared value."""
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value


def parse(ex: Exchange, request: Mapping[str, Any]) -> list[ParsedCall]:
    prompts = _prompts(request)
    params_all = request.get("sampling_params") or {}
    parsed: list[ParsedCall] = []
    samples: list[int] = []
    for i, prompt in enumerate(prompts):
        params = _item(params_all, i)
        body = dict(request)
        body["rid"] = _item(request.get("rid"), i)
        call = new_call(ex, DIALECT.name, request)
        call.sampling = dict(params) if isinstance(params, dict) else {}
        call.prompt = prompt
        parsed.append(ParsedCall(call, body))
        n = params.get("n", 1) if isinstance(params, dict) else 1
        samples.append(n if isinstance(n, int) and n > 0 else 1)
    try:
        _fill(parsed, samples, ex)
    except ParseError as exc:
        unparsed_response([p.call for p in parsed], exc)
    return parsed


def _fill(parsed: list[ParsedCall], samples: list[int], ex: Exchange) -> None:
    first = parsed[0].call
    body = fill_response(first, ex)
    for p in parsed[1:]:
        p.call.error = first.error
    if body is not None:
        items = body if isinstance(body, list) else [body]
        _assign([(i, obj) for i, obj in enumerate(items)], parsed, samples)
    elif ex.is_event_stream and ex.status is not None and ex.status < 400:
        final: dict[int, dict[str, Any]] = {}
        for event in stream_events(ex):
            if "error" in event and "meta_info" not in event:
                for p in parsed:
                    p.call.error = stream_error(event)
                continue
            index = index_of(event, "chunk")
            final[index] = _merge_chunk(final.get(index), event)
        _assign(sorted(final.items()), parsed, samples)


def _merge_chunk(previous: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """Fold a chunk into the running object, whether the stream is cumulative or incremental."""
    ids = as_int_list(chunk.get("output_ids")) or []
    meta = as_object(chunk.get("meta_info"), "a chunk's meta_info")
    if previous is None:
        return {**chunk, "output_ids": ids}
    done = meta.get("completion_tokens")
    seen = previous["output_ids"]
    cumulative = done == len(ids) if isinstance(done, int) else ids[: len(seen)] == seen
    if cumulative:
        return {**chunk, "output_ids": ids}
    merged_meta = dict(meta)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        old = as_object(previous.get("meta_info"), "a chunk's meta_info").get(key)
        if isinstance(old, list) and isinstance(meta.get(key), list):
            merged_meta[key] = old + meta[key]
    return {
        **chunk,
        "text": (text_of(previous.get("text")) or "") + (text_of(chunk.get("text")) or ""),
        "output_ids": previous["output_ids"] + ids,
        "meta_info": merged_meta,
    }


def _owner(k: int, samples: list[int]) -> tuple[int, int] | None:
    """Object k's prompt and sample, in prompt-major order (without listing every pair: a
    request may ask for any `n`)."""
    for i, n in enumerate(samples):
        if k < n:
            return i, k
        k -= n
    return None


def _assign(items: list[tuple[int, Any]], parsed: list[ParsedCall], samples: list[int]) -> None:
    """Object k belongs to prompt i, sample j, in prompt-major order."""
    for k, obj in items:
        owner = _owner(k, samples)
        if not isinstance(obj, dict) or owner is None:
            raise ParseError("response objects do not match the request's prompts and n")
        i, j = owner
        call = parsed[i].call
        meta = as_object(obj.get("meta_info"), "an object's meta_info")
        finish = meta.get("finish_reason")
        call.outputs.append(
            Output(
                index=j,
                text=_text(obj.get("text")),
                token_ids=as_int_list(obj.get("output_ids")),
                logprobs=_logprobs(meta.get("output_token_logprobs")),
                finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
                stop_reason=finish.get("matched") if isinstance(finish, dict) else None,
            )
        )
        call.request_id = call.request_id or text_of(meta.get("id"))
        call.error = _refusal(finish) or call.error
        if meta.get("weight_version") is not None:
            call.weight_version = str(meta["weight_version"])
        usage = {
            k: meta[k]
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
            if isinstance(meta.get(k), int) and not isinstance(meta[k], bool)
        }
        if usage:
            if call.usage is None:
                call.usage = usage
            else:
                call.usage["completion_tokens"] = call.usage.get(
                    "completion_tokens", 0
                ) + usage.get("completion_tokens", 0)


def _refusal(finish: Any) -> CallError | None:
    """An abort with an HTTP error status, as the tokenizer manager tells a refusal from a
    graceful abort (`_handle_abort_finish_reason`: 400 <= status_code < 600)."""
    if not isinstance(finish, dict) or finish.get("type") != "abort":
        return None
    status = finish.get("status_code")
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status < 600:
        return None
    kind = finish.get("err_type")
    message = text_of(finish.get("message")) or ""
    return CallError(
        type=kind if isinstance(kind, str) and kind else f"http_{status}",
        message=message[:MAX_ERROR_MESSAGE],
    )


def _text(value: Any) -> Any:
    """The output's text; also a list of texts, which is how vLLM's legacy `/generate`
    answers on this route (one per sample, the prompt included), kept as it came."""
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return value
    return text_of(value)


def _logprobs(entries: Any) -> list[float] | None:
    """The first item of each `[logprob, token_id, text]` (None when one is not a number)."""
    if not isinstance(entries, list):
        return None
    values = []
    for entry in entries:
        if isinstance(entry, list) and entry:
            value = entry[0]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None
            values.append(float(value))
    return values
