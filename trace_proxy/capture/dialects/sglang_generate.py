"""SGLang's native route (`POST|PUT /generate`), used by slime and AReaL.

A request holds one prompt (`text` or `input_ids`) or a batch; with a batch or `n` > 1 the
non-streamed answer is a JSON list, one object per prompt x sample, and streamed chunks carry
`index`. Streams are cumulative by default (each chunk repeats all text and ids so far) and
incremental with `--incremental-streaming-output`; `meta_info.completion_tokens` tells which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trace_proxy.capture.dialects.common import (
    ParsedCall,
    ParseError,
    as_int_list,
    as_prompt_ids,
    fill_response,
    new_call,
    stream_error,
    stream_events,
)
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.record import Output, Prompt

NAME = "sglang.generate"
ROUTES = ("/generate",)
PROMPT_IDS = "input_ids"  # the request field that may hold the prompt's token ids


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
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [Prompt(text=t) for t in text]
    raise ParseError("request has neither 'text' nor 'input_ids'")


def _item(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


def parse(ex: Exchange, request: Mapping[str, Any]) -> list[ParsedCall]:
    prompts = _prompts(request)
    params_all = request.get("sampling_params") or {}
    parsed: list[ParsedCall] = []
    samples: list[int] = []
    for i, prompt in enumerate(prompts):
        params = _item(params_all, i)
        body = dict(request)
        body["rid"] = _item(request.get("rid"), i)
        call = new_call(ex, NAME, request)
        call.sampling = dict(params) if isinstance(params, dict) else {}
        call.prompt = prompt
        parsed.append(ParsedCall(call, body))
        n = params.get("n", 1) if isinstance(params, dict) else 1
        samples.append(n if isinstance(n, int) and n > 0 else 1)
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
            index = int(event.get("index") or 0)
            final[index] = _merge_chunk(final.get(index), event)
        _assign(sorted(final.items()), parsed, samples)
    return parsed


def _merge_chunk(previous: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """Fold a chunk into the running object, whether the stream is cumulative or incremental."""
    ids = as_int_list(chunk.get("output_ids")) or []
    meta = chunk.get("meta_info") or {}
    if previous is None:
        return {**chunk, "output_ids": ids}
    done = meta.get("completion_tokens")
    seen = previous["output_ids"]
    cumulative = done == len(ids) if isinstance(done, int) else ids[: len(seen)] == seen
    if cumulative:
        return {**chunk, "output_ids": ids}
    merged_meta = dict(meta)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        old = (previous.get("meta_info") or {}).get(key)
        if isinstance(old, list) and isinstance(meta.get(key), list):
            merged_meta[key] = old + meta[key]
    return {
        **chunk,
        "text": (previous.get("text") or "") + (chunk.get("text") or ""),
        "output_ids": previous["output_ids"] + ids,
        "meta_info": merged_meta,
    }


def _assign(items: list[tuple[int, Any]], parsed: list[ParsedCall], samples: list[int]) -> None:
    """Object k belongs to prompt i, sample j, in prompt-major order."""
    owners = [(i, j) for i, n in enumerate(samples) for j in range(n)]
    for k, obj in items:
        if not isinstance(obj, dict) or k >= len(owners):
            raise ParseError("response objects do not match the request's prompts and n")
        i, j = owners[k]
        call = parsed[i].call
        meta = obj.get("meta_info") or {}
        finish = meta.get("finish_reason")
        logprobs = meta.get("output_token_logprobs")
        call.outputs.append(
            Output(
                index=j,
                text=obj.get("text") or None,
                token_ids=as_int_list(obj.get("output_ids")),
                logprobs=[float(t[0]) for t in logprobs if isinstance(t, list) and t]
                if isinstance(logprobs, list)
                else None,
                finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
                stop_reason=finish.get("matched") if isinstance(finish, dict) else None,
            )
        )
        call.request_id = call.request_id or meta.get("id")
        if meta.get("weight_version") is not None:
            call.weight_version = str(meta["weight_version"])
        usage = {
            k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens") if k in meta
        }
        if usage:
            if call.usage is None:
                call.usage = usage
            else:
                call.usage["completion_tokens"] = call.usage.get(
                    "completion_tokens", 0
                ) + usage.get("completion_tokens", 0)
