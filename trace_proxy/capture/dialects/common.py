"""Pieces every dialect parser shares: the call skeleton, errors, streams, logprobs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from trace_proxy import safejson
from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.redact import recorded_headers
from trace_proxy.capture.sse import iter_data
from trace_proxy.trajectories.keys import WEIGHT_VERSION_HEADER
from trace_proxy.trajectories.record import (
    CallError,
    GenerateCall,
    IdsText,
    Output,
    TokenIds,
    has_line_break,
    ids_text_tail,
)

# Request fields that are content or transport, not sampling parameters.
NON_SAMPLING_FIELDS = frozenset(
    {
        "messages", "prompt", "tools", "tool_choice", "model", "stream", "stream_options",
        "token_ids", "input_ids", "text", "sampling_params", "rid", "request_id", "user",
        "metadata", "session_id", "return_token_ids", "return_logprob", "chat_template",
        "chat_template_kwargs", "image_data", "video_data", "audio_data", "input_embeds",
        "lora_path", "lora_name", "extra_body", "return_prompt_token_ids", "output_mode",
    }
)  # fmt: skip
MAX_ERROR_MESSAGE = 2000


class ParseError(ValueError):
    """The body is not what the dialect expects; the call is recorded as unparsed."""


@dataclass(slots=True)
class ParsedCall:
    """A call plus the request fields that body mapping rules may read (per batch item)."""

    call: GenerateCall
    body: Mapping[str, Any]


def new_call(ex: Exchange, dialect: str, request: Mapping[str, Any]) -> GenerateCall:
    return GenerateCall(
        index=-1,
        dialect=dialect,
        route=ex.path,
        upstream=ex.upstream,
        start=ex.start,
        end=ex.end,
        first_byte=ex.first_byte,
        http_status=ex.status,
        stream=bool(request.get("stream")),
        model=request.get("model") if isinstance(request.get("model"), str) else None,
        sampling={k: v for k, v in request.items() if k not in NON_SAMPLING_FIELDS},
        request_headers=recorded_headers(ex.request_headers.items()),
    )


def exchange_failure(ex: Exchange) -> CallError | None:
    """The transport failure (upstream down, timeout, client gone), else the server's error."""
    if ex.error is not None:
        return CallError(type="transport", message=ex.error)
    if ex.status is None or ex.status < 400:
        return None
    try:
        body: Any = orjson.loads(ex.response_body)
    except orjson.JSONDecodeError:
        body = ex.response_body[:MAX_ERROR_MESSAGE]
    return http_error(ex.status, body)


def http_error(status: int | None, body: Any) -> CallError | None:
    """vLLM and SGLang error bodies: {"error": {...}} / {"error": "..."} / {"message": ...}."""
    if status is None or status < 400:
        return None
    message: Any = None
    if isinstance(body, dict):
        err = body.get("error", body)
        message = err.get("message", err) if isinstance(err, dict) else err
        if message is None:
            message = body.get("message") or body.get("detail")
    elif isinstance(body, (bytes, str)):
        message = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = message if isinstance(message, str) else safejson.dumps(message).decode()
    return CallError(type=f"http_{status}", message=text[:MAX_ERROR_MESSAGE])


def stream_failure(ex: Exchange) -> CallError | None:
    """The first error event of a 2xx event stream: servers refuse some requests after their
    200 (SGLang's `/generate` raises its validation errors once the stream has begun)."""
    if not ex.is_event_stream or ex.status is None or ex.status >= 400:
        return None
    try:
        for event in stream_events(ex):
            if "error" in event and "meta_info" not in event:
                return stream_error(event)
    except ParseError:
        return None
    return None


def stream_error(event: Mapping[str, Any]) -> CallError:
    err = event.get("error")
    if isinstance(err, dict):
        kind = str(err.get("type") or "stream_error")
        message = err.get("message")
        return CallError(type=kind, message=str(message)[:MAX_ERROR_MESSAGE])
    return CallError(type="stream_error", message=str(err)[:MAX_ERROR_MESSAGE])


def as_object(value: Any, what: str) -> Mapping[str, Any]:
    """An object of a response (a choice, a message, a delta): {} when absent or null. Any
    other value makes the response unparsed (ParseError), rather than a parser error."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParseError(f"{what} is not an object")
    return value


def as_list(value: Any, what: str) -> list[Any]:
    """A list of a response (choices, tool-call fragments): [] when absent or null."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ParseError(f"{what} is not a list")
    return value


def index_of(item: Mapping[str, Any], what: str) -> int:
    """A choice's or a chunk's `index` (0 when absent): a non-negative integer, or the
    response is unparsed."""
    value = item.get("index")
    try:
        index = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        raise ParseError(f"{what} index {str(value)[:40]!r} is not an integer") from None
    if index < 0:
        raise ParseError(f"{what} index {index} is negative")
    return index


def text_of(value: Any) -> str | None:
    """A string field (text, an id, a model name) as the record types it: else None."""
    return value if isinstance(value, str) and value else None


def usage_of(value: Any) -> dict[str, Any] | None:
    """Token counts, when they are an object."""
    return value if isinstance(value, dict) else None


def unparsed_response(calls: list[GenerateCall], exc: ParseError) -> None:
    """The request was understood and the response not: the calls keep their prompts and
    parameters, and say why they have no outputs."""
    for call in calls:
        call.unparsed = str(exc)
        call.outputs = []


def load_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ParseError(f"response is not JSON: {exc}") from None


def _list_after(body: bytes, position: int) -> tuple[int, int] | None:
    """Where the `[` that follows `position` (after blanks) and the first `]` after it are."""
    while position < len(body) and body[position] in b" \t\r\n":
        position += 1
    end = body.find(b"]", position)
    if body[position : position + 1] != b"[" or end < 0:
        return None
    return position, end


LatestPrompt = Callable[[dict[str, Any]], tuple[bytes, int] | None]


def decode_request(
    body: bytes, ids_field: str | None, latest: LatestPrompt | None = None
) -> tuple[Any, bytes | None]:
    """The request as `orjson.loads` gives it, and the JSON text of its top-level `ids_field`
    list (between the brackets, trimmed) when that is where the list of ids is.

    With that text the assembler sees that a prompt extends the previous one by comparing bytes
    instead of tens of thousands of ints. The list and the rest are decoded apart, which costs
    what one decode does; anything unusual (the field nested or repeated, a list of lists) is
    decoded in one piece, with no text. The first `]` after the field's `[` ends the list
    exactly when the text up to it decodes as a list: an earlier `]` leaves a string or an
    inner list open.

    `latest`, given the rest of the request, names the text of a list already known to be
    ids (the latest prompt of the trajectory it belongs to, or a sibling rollout's first
    prompt) and how many. When this list is that one, or that one followed by more ids, only
    those more are decoded, and the list stays text (`IdsText`): a multi-turn prompt's
    earlier turns are not decoded again on every turn.
    """
    if ids_field is None:
        return orjson.loads(body), None
    key = b'"' + ids_field.encode() + b'":'
    found = body.find(key)
    if found < 0:
        return orjson.loads(body), None
    span = _list_after(body, found + len(key))
    if span is None:
        return orjson.loads(body), None
    start, end = span
    rest = body[:start] + b"null" + body[end + 1 :]
    try:
        request = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return orjson.loads(body), None
    if (
        not isinstance(request, dict)
        or request.get(ids_field, 0) is not None  # the cut list was not the top-level field
        or rest.find(key, found + 1) >= 0  # the field again, nested or repeated
    ):
        return orjson.loads(body), None
    text = body[start + 1 : end].strip()
    ids: list[Any] | IdsText | None = None
    if latest is not None:
        ids = _continued_ids(text, latest(request))
        if ids is not None:
            text = ids.text  # the known text itself when the same: held once
    if ids is None:
        try:
            ids = orjson.loads(memoryview(body)[start : end + 1])
        except orjson.JSONDecodeError:
            return orjson.loads(body), None
        if not isinstance(ids, list):
            return orjson.loads(body), None
    request[ids_field] = ids
    return request, text


def _continued_ids(text: bytes, known: tuple[bytes, int] | None) -> IdsText | None:
    """`text` as ids when it is `known`'s text, or that followed by a comma and more ids
    (only those decoded): then the whole list decodes to ints too. Else None."""
    if known is None or has_line_break(text):
        return None
    base, count = known
    if text == base:
        return IdsText(base, count)
    tail = ids_text_tail(text, base)
    if tail is None:
        return None
    try:
        more = orjson.loads(b"[" + tail + b"]")
    except orjson.JSONDecodeError:
        return None
    if not more or as_int_list(more) is None:
        return None  # `[known,]` is not JSON; `[known, 1.5]` not ids
    return IdsText(text, count + len(more), base, more)


ECHO_KEY = b'"prompt_token_ids":'


def without_prompt_echo(body: bytes) -> bytes:
    """`body` with the value of every `"prompt_token_ids": [ids]` replaced by `null`.

    vLLM echoes the prompt's ids in each response (`return_token_ids`). When the request
    carried them already, decoding the echo is the largest single cost of parsing a
    long-prompt response (0.7 ms for 32k ids, against 0.07 ms to cut it out). Only a flat list
    of numbers (or literals) is cut: with no string, list or object in it (three byte searches,
    a fifth of checking each byte), its first `]` is its end; anything else stays, and the body
    is decoded in full. Its items are not checked: the request's ids are the record's.
    """
    found = body.find(ECHO_KEY)
    if found < 0:
        return body
    pieces: list[bytes] = []
    done = 0
    while found >= 0:
        span = _list_after(body, found + len(ECHO_KEY))
        if span is None:
            return body
        value, end = span
        if _not_flat(body, value + 1, end):
            return body  # a string, list or object in it: its first `]` may not be its end
        pieces += (body[done:value], b"null")
        done = end + 1
        found = body.find(ECHO_KEY, done)
    pieces.append(body[done:])
    return b"".join(pieces)


def _not_flat(body: bytes, start: int, end: int) -> bool:
    return (
        body.find(b'"', start, end) >= 0
        or body.find(b"[", start, end) >= 0
        or (body.find(b"{", start, end) >= 0)
    )


def stream_events(ex: Exchange, skip_prompt_echo: bool = False) -> Iterator[dict[str, Any]]:
    """Decoded `data:` events of a streamed response, stopping at `[DONE]`.

    `skip_prompt_echo`: the request carried the prompt's ids, so the echo is not decoded."""
    for payload in iter_data(ex.response_body):
        if payload.strip() == b"[DONE]":
            return
        if skip_prompt_echo:
            payload = without_prompt_echo(payload)
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ParseError(f"stream event is not JSON: {exc}") from None
        if isinstance(event, dict):
            yield event


def chosen_logprobs(logprobs: Any) -> list[float] | None:
    """The sampled tokens' logprobs from any of the OpenAI/vLLM shapes (None when they are
    not numbers: a list with gaps would no longer line up with the tokens)."""
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if isinstance(content, list):
        values = [item.get("logprob") for item in content if isinstance(item, dict)]
        return _floats(values, missing=None)
    token_logprobs = logprobs.get("token_logprobs")
    if isinstance(token_logprobs, list):
        return _floats(token_logprobs, missing=float("nan"))
    return None


_FLOAT = frozenset({float})
_NUMBER = frozenset({float, int})


def _floats(values: list[Any], missing: float | None) -> list[float] | None:
    """Numbers as floats; None (the JSON null) as `missing`; anything else: None for all."""
    types = set(map(type, values))  # in C: the usual lists are all floats
    if types <= _FLOAT:
        return values
    if types <= _NUMBER:
        return list(map(float, values))
    out = []
    for value in values:
        if value is None and missing is not None:
            out.append(missing)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))
        else:
            return None
    return out


def ids_from_logprob_tokens(logprobs: Any) -> list[int] | None:
    """With `return_tokens_as_token_ids` (AReaL's payload), vLLM names each sampled token
    `"token_id:123"` in the logprobs instead of returning `token_ids`."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens")  # completions
    if tokens is None and isinstance(logprobs.get("content"), list):  # chat
        tokens = [item.get("token") for item in logprobs["content"] if isinstance(item, dict)]
    if not isinstance(tokens, list) or not tokens:
        return None
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith("token_id:"):
            return None
        try:
            ids.append(int(token[len("token_id:") :]))
        except ValueError:
            return None
    return ids


def normalize_tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool calls in one shape: {id, type, function: {name, arguments}}."""
    if not isinstance(calls, list) or not calls:
        return None
    normal = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        fn = call.get("function")
        fn = fn if isinstance(fn, dict) else {}
        normal.append(
            {
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""},
            }
        )
    return normal or None


def weight_version_of(choice: Mapping[str, Any]) -> str | None:
    """The policy version that produced the last tokens of a choice.

    vLLM reports spans, `[{"version": "v3", "start": 0, "end": 12}, ...]`, one per weight
    version seen while generating (a version can change mid-request); older builds a list of
    strings. The last span's version is the one that finished the output.
    """
    versions = choice.get("weight_versions")
    if isinstance(versions, list) and versions:
        last = versions[-1]
        version = last.get("version") if isinstance(last, dict) else last
        return None if version is None else str(version)
    if isinstance(versions, (str, int)) and not isinstance(versions, bool):
        return str(versions)
    return None


MAX_VERSION_LEN = 256


def weight_version_header(headers: Mapping[str, str]) -> str | None:
    """The policy version the client says produced this call (a trainer that knows it, as
    the verl plugin does: vLLM's `/v1/completions` reports none); None when absent or not a
    short printable value."""
    value = headers.get(WEIGHT_VERSION_HEADER)
    if not value or len(value) > MAX_VERSION_LEN or not value.isprintable():
        return None
    return safejson.clean_text(value)


def as_int_list(value: Any) -> list[int] | None:
    """`value` if it is a list of integers (token ids), else None. Checked in C: prompts run to
    tens of thousands of ids. Summing rejects a float (the sum is a float) and anything not a
    number (it raises); JSON's `true` and `false` sum as integers, so a second pass looks for
    them by type (about 35 us for 30,000 ids)."""
    if not isinstance(value, list):
        return None
    try:
        if type(sum(value)) is not int:
            return None
    except TypeError:
        return None
    return None if bool in map(type, value) else value


def as_prompt_ids(value: Any) -> TokenIds | None:
    """A request's prompt ids: as `as_int_list`, and a list `decode_request` kept as text."""
    return value if isinstance(value, IdsText) else as_int_list(value)


class ChoiceStream:
    """Rebuilds per-choice outputs from streamed deltas, so a stream yields the record the
    non-streamed response would have: text and token ids concatenated, tool-call fragments merged
    by index, the last non-null finish reason kept."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._reasoning: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[float]] = {}
        self._tools: dict[int, dict[int, dict[str, Any]]] = {}
        self._finish: dict[int, Any] = {}
        self._stop: dict[int, Any] = {}
        self.prompt_token_ids: dict[int, list[int]] = {}

    def add(self, choice: Mapping[str, Any], text: Any, reasoning: Any = None) -> None:
        index = index_of(choice, "choice")
        self._text.setdefault(index, [])
        if isinstance(text, str) and text:
            self._text[index].append(text)
        if isinstance(reasoning, str) and reasoning:
            self._reasoning.setdefault(index, []).append(reasoning)
        ids = as_int_list(choice.get("token_ids")) or ids_from_logprob_tokens(
            choice.get("logprobs")
        )
        if ids:
            self._ids.setdefault(index, []).extend(ids)
        prompt_ids = as_int_list(choice.get("prompt_token_ids"))
        if prompt_ids is not None and index not in self.prompt_token_ids:
            self.prompt_token_ids[index] = prompt_ids
        logprobs = chosen_logprobs(choice.get("logprobs"))
        if logprobs:
            self._logprobs.setdefault(index, []).extend(logprobs)
        if choice.get("finish_reason") is not None:
            self._finish[index] = choice["finish_reason"]
        stop = choice.get("stop_reason")
        if stop is None:
            stop = choice.get("matched_stop")  # SGLang's name for it
        if stop is not None:
            self._stop[index] = stop

    def add_tool_fragments(self, index: int, fragments: Any) -> None:
        if not isinstance(fragments, list):
            return
        calls = self._tools.setdefault(index, {})
        for fragment in fragments:
            if not isinstance(fragment, dict):
                continue
            entry = calls.setdefault(
                index_of(fragment, "tool call"),
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if fragment.get("id"):
                entry["id"] = fragment["id"]
            if fragment.get("type"):
                entry["type"] = fragment["type"]
            fn = as_object(fragment.get("function"), "a tool call's function")
            if fn.get("name"):
                entry["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                entry["function"]["arguments"] += fn["arguments"]

    def outputs(self) -> list[Output]:
        indexes = sorted(set(self._text) | set(self._ids) | set(self._finish) | set(self._tools))
        return [
            Output(
                index=i,
                text="".join(self._text.get(i, [])) or None,
                token_ids=self._ids.get(i),
                logprobs=self._logprobs.get(i),
                finish_reason=self._finish.get(i),
                stop_reason=self._stop.get(i),
                tool_calls=normalize_tool_calls(
                    [self._tools[i][k] for k in sorted(self._tools[i])]
                    if i in self._tools
                    else None
                ),
                reasoning="".join(self._reasoning.get(i, [])) or None,
            )
            for i in indexes
        ]


def fill_response(call: GenerateCall, ex: Exchange, skip_prompt_echo: bool = False) -> Any:
    """Set errors common to every dialect; return the decoded JSON body of a non-stream 2xx
    response, or None when there is nothing more to read (error, stream handled by caller).

    `skip_prompt_echo`: the request carried the prompt's ids, so the echo is not decoded."""
    call.error = exchange_failure(ex)
    if ex.status is None or ex.status >= 400 or ex.is_event_stream:
        return None
    body = ex.response_body
    return load_json(without_prompt_echo(body) if skip_prompt_echo else body)
