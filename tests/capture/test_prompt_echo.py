"""Token-id lists that cost the capture process most: the prompt's ids that vLLM echoes are not
decoded when the request carried them, and a request's ids are found as JSON text too. The
record must be the one a full decode gives, and every other field must be untouched."""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from trace_proxy.capture.dialects import openai_completions, vllm_generate
from trace_proxy.capture.dialects.common import decode_request, without_prompt_echo
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.record import IdsText, has_line_break

ECHO = "prompt_token_ids"
ids = st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False)
integers = st.integers(min_value=-(2**63), max_value=2**63 - 1)  # what orjson keeps as int
scalars = st.none() | st.booleans() | integers | finite | st.text()
# Keys a response may hold, including strings that spell the echo's key inside another value.
keys = st.sampled_from(
    ["text", "id", ECHO, f'x"{ECHO}', f'"{ECHO}":[', f'{ECHO}":[1]', "token_ids"]
)
values = st.recursive(
    scalars | ids | st.sampled_from([f'"{ECHO}":[1,2]', f'{{"{ECHO}":[3]}}']),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)
documents = st.dictionaries(keys, values, max_size=6)
separators = st.sampled_from([(",", ":"), (", ", ": "), (",", ": "), (" , ", ":  ")])


def is_echo(key: str) -> bool:
    """The keys whose serialised form ends in `"prompt_token_ids"`: the echo itself, and (a
    quote escaped inside a longer key) any key ending in `"prompt_token_ids`."""
    return key == ECHO or key.endswith(f'"{ECHO}')


def echoes(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [found for item in value for found in echoes(item)]
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in ([item] if is_echo(key) else echoes(item))
        ]
    return []


def nulled(value: Any) -> Any:
    if isinstance(value, list):
        return [nulled(item) for item in value]
    if isinstance(value, dict):
        return {key: None if is_echo(key) else nulled(item) for key, item in value.items()}
    return value


def plain_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def flat(value: Any) -> bool:
    """A list with no string, list or object in it: what the echo's cut takes."""
    return isinstance(value, list) and not any(isinstance(v, (str, list, dict)) for v in value)


@settings(max_examples=400, deadline=None)
@given(documents, separators)
def test_only_echoed_flat_lists_are_cut_and_nothing_else_changes(
    document: dict[str, Any], separator: tuple[str, str]
) -> None:
    body = json.dumps(document, separators=separator).encode()
    decoded = orjson.loads(without_prompt_echo(body))
    if all(flat(found) for found in echoes(document)):
        assert decoded == nulled(document)
    else:  # an echo that is not a flat list: the body is decoded in full
        assert decoded == document


def test_a_body_without_an_echo_is_the_same_object() -> None:
    body = b'{"choices":[{"text":"hi","token_ids":[1,2]}]}'
    assert without_prompt_echo(body) is body
    spaced = b'{"prompt_token_ids" : [1, 2]}'  # no server writes this: decoded in full
    assert without_prompt_echo(spaced) is spaced


def exchange(path: str, request: dict[str, Any], response: bytes, stream: bool) -> Exchange:
    now = time.time()
    content_type = "text/event-stream" if stream else "application/json"
    return Exchange(
        "POST", path, "", CIMultiDictProxy(CIMultiDict()), [], "http://upstream", now,
        request_body=orjson.dumps(request), status=200, end=now, first_byte=now,
        response_headers=CIMultiDict({"Content-Type": content_type}),
        response_chunks=[response],
    )  # fmt: skip


def completion(prompt_echo: list[int], stream: bool) -> bytes:
    choice = {
        "index": 0, "text": " Paris", "finish_reason": "length", "stop_reason": None,
        "token_ids": [12095, 13], "prompt_token_ids": prompt_echo, "weight_versions": None,
    }  # fmt: skip
    if not stream:
        body = {"id": "cmpl-1", "model": "m", "choices": [choice], "usage": {"prompt_tokens": 3}}
        return orjson.dumps(body)
    first = {"id": "cmpl-1", "model": "m", "choices": [choice]}
    usage = {"id": "cmpl-1", "model": "m", "choices": [], "usage": {"prompt_tokens": 3}}
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in (first, usage)) + (
        b"data: [DONE]\n\n"
    )


def test_completions_keep_the_request_ids_and_read_the_echo_only_for_a_text_prompt() -> None:
    for stream in (False, True):
        # The echo differs on purpose: with ids in the request, it is not what is recorded.
        with_ids = {"model": "m", "prompt": [785, 6722, 315], "stream": stream}
        ex = exchange("/v1/completions", with_ids, completion([9, 9, 9], stream), stream)
        (parsed,) = openai_completions.parse(ex, with_ids)
        assert parsed.call.prompt.token_ids == [785, 6722, 315]
        assert parsed.call.outputs[0].token_ids == [12095, 13]
        assert parsed.call.outputs[0].text == " Paris"
        assert parsed.call.usage == {"prompt_tokens": 3}

        with_text = {"model": "m", "prompt": "The capital of France is", "stream": stream}
        ex = exchange("/v1/completions", with_text, completion([785, 6722, 315], stream), stream)
        (parsed,) = openai_completions.parse(ex, with_text)
        assert parsed.call.prompt.token_ids == [785, 6722, 315]
        assert parsed.call.prompt.text == "The capital of France is"


def test_vllm_generate_records_the_request_ids_and_every_output_field() -> None:
    request = {"token_ids": [785, 6722], "sampling_params": {"max_tokens": 2}}
    response = {
        "request_id": "generate-tokens-1", "model": "m", "prompt_token_ids": [785, 6722],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
        "choices": [{"index": 0, "finish_reason": "length", "token_ids": [12095, 13],
                     "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}],
    }  # fmt: skip
    ex = exchange("/inference/v1/generate", request, orjson.dumps(response), False)
    (parsed,) = vllm_generate.parse(ex, request)
    call = parsed.call
    assert call.prompt.token_ids == [785, 6722]
    assert (call.request_id, call.model) == ("generate-tokens-1", "m")
    assert call.usage == response["usage"]
    assert call.outputs[0].token_ids == [12095, 13]
    assert call.outputs[0].logprobs == [-0.5, -0.25]


id_lists = st.lists(st.integers(min_value=0, max_value=200_000), max_size=30)
requests = st.fixed_dictionaries(
    {"prompt": id_lists | st.lists(id_lists, min_size=1, max_size=3) | st.text(max_size=10)},
    optional={
        "model": st.text(max_size=8),
        "metadata": st.dictionaries(st.sampled_from(["prompt", "note"]), id_lists | st.text()),
        "stop": st.lists(st.sampled_from(["]", '"prompt":[', "[1]"]), max_size=3),
        "max_tokens": st.integers(0, 100),
    },
)


@settings(max_examples=400, deadline=None)
@given(requests, separators, st.booleans())
def test_a_request_decoded_in_two_parts_is_the_request_and_its_ids_text_their_text(
    request: dict[str, Any], separator: tuple[str, str], prompt_first: bool
) -> None:
    if not prompt_first:  # the field after the others, nested "prompt" keys first
        others = {k: v for k, v in request.items() if k != "prompt"}
        request = {**others, "prompt": request["prompt"]}
    body = json.dumps(request, separators=separator).encode()
    decoded, text = decode_request(body, "prompt")
    assert decoded == orjson.loads(body)
    if text is not None:
        assert orjson.loads(b"[" + text + b"]") == decoded["prompt"]
        assert text == text.strip()
    if plain_ids(request["prompt"]) and "prompt" not in request.get("metadata", {}):
        assert text is not None  # the usual request: the text is found


# What may follow the ids of the latest prompt in the next request's text: more ids, and what
# would make the whole list not JSON or not ids (the tail is all that gets decoded).
PIECES = [b",", b", ", b" ,", b",\n", b"\n", b"7", b"12", b"0", b"-3", b"1.5", b"1e3", b"true"]
PIECES += [b'"a"', b"[1]", b"[", b"null", b"123456789012345678901234567890", b"01", b" "]
tails = st.lists(st.sampled_from(PIECES), max_size=8).map(b"".join)


@settings(max_examples=600, deadline=None)
@given(id_lists.filter(bool), tails, separators)
def test_a_prompt_continuing_the_latest_decodes_as_the_whole_request_does(
    base: list[int], tail: bytes, separator: tuple[str, str]
) -> None:
    """Only the ids after the latest prompt's are decoded; the result (or the error) must be
    what decoding the whole body gives."""
    first = json.dumps({"prompt": base}, separators=separator).encode()
    _, base_text = decode_request(first, "prompt")
    assert base_text is not None
    body = b'{"max_tokens":4,"prompt":[' + base_text + tail + b'],"n":1}'
    try:
        expected = orjson.loads(body)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            decode_request(body, "prompt", lambda _: (base_text, len(base)))
        return
    decoded, text = decode_request(body, "prompt", lambda _: (base_text, len(base)))
    prompt = decoded["prompt"]
    if isinstance(prompt, IdsText):
        assert all(isinstance(v, int) for v in expected["prompt"])
        assert prompt.text == text
        assert prompt.count == len(expected["prompt"])
        assert not has_line_break(prompt.text)  # a record stays one line
        decoded["prompt"] = prompt.decode()
    assert decoded == expected
