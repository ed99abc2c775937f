"""Retokenization drift: where the token ids a trajectory trains on are not the ids generated.

In RL the ids trained on must be the ids the model produced. A client that keeps a reply as
text and sends it back (re-tokenized by the server), or a chat template that rewrites earlier
turns (dropping a thinking block), changes them. Two checks per call, with the served model's
tokenizer, where the ids are known:

- prefix: the next call's prompt ids begin with this call's prompt ids and response ids. A
  trailing special token of the response (the stop token, which servers strip from the text)
  may be left out. Checked only where the next call continues this one: its prompt ids extend
  this call's whole prompt, or its decoded prompt begins with this call's decoded prompt and
  response. Anything else (a retry, another conversation) is not judged.
- roundtrip: `encode(decode(ids))` gives a response's ids back, i.e. a client that keeps the
  text would send the same ids again.

Prompt ids are the record's; a `/v1/completions` call whose text prompt came back without its
ids gets them by encoding that text as the server does (`Codec.encode_prompt`).

A call that drifts gets `drift` (`{"prefix": {...}, "roundtrip": {...}}`, each naming the first
differing position and the two tokens there); a check that cannot be made records nothing.
The checks run where token2text decodes (the export process, once per kept trajectory), never
on a request's path; their cost is bounded by the ids compared (benchmarks/decode.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trace_proxy.trajectories.dialects import dialect_named
from trace_proxy.trajectories.prompts import common_prefix
from trace_proxy.trajectories.record import GenerateCall, Trajectory

KINDS = ("prefix", "roundtrip")
# Tokens decoded before the first difference, so the two texts compared start at one boundary.
_BACK = 8


@dataclass(frozen=True, slots=True)
class Codec:
    """A tokenizer as the checks need it: decoding with special tokens kept, encoding without
    adding any, encoding a prompt as a server does (its BOS added, where it has one), one
    token's text, and which ids are special (a response's stop token)."""

    decode: Callable[[Sequence[int]], str]
    encode: Callable[[str], list[int]]
    encode_prompt: Callable[[str], list[int]]
    special: frozenset[int]

    def piece(self, token: int | None) -> str | None:
        return None if token is None else self.decode([token])


def codec_for(tokenizer: Any) -> Codec:
    """The Rust backend where there is one (what token2text decodes with), else the tokenizer."""
    special = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
    special |= frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:

        def decode_backend(ids: Sequence[int]) -> str:
            return str(backend.decode(list(ids), skip_special_tokens=False))

        def encode_backend(text: str) -> list[int]:
            return list(backend.encode(text, add_special_tokens=False).ids)

        def encode_prompt_backend(text: str) -> list[int]:
            return list(backend.encode(text, add_special_tokens=True).ids)

        return Codec(decode_backend, encode_backend, encode_prompt_backend, special)

    def decode_python(ids: Sequence[int]) -> str:
        return str(
            tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def encode_python(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt_python(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=True))

    return Codec(decode_python, encode_python, encode_prompt_python, special)


def difference(
    codec: Codec, expected: Sequence[int], got: Sequence[int], at: int
) -> dict[str, Any]:
    """The first differing position and the two tokens there (None past an end)."""
    want = expected[at] if at < len(expected) else None
    have = got[at] if at < len(got) else None
    return {
        "at": at,
        "expected": want,
        "got": have,
        "expected_text": codec.piece(want),
        "got_text": codec.piece(have),
    }


def roundtrip_drift(codec: Codec, response: Sequence[int]) -> dict[str, Any] | None:
    """Where `encode(decode(response))` first differs from `response`; None when it is the
    same."""
    again = codec.encode(codec.decode(response))
    if len(again) == len(response) and again == list(response):
        return None
    return difference(codec, response, again, common_prefix(response, again))


def prefix_drift(
    codec: Codec, prompt: Sequence[int], response: Sequence[int], following: Sequence[int]
) -> dict[str, Any] | None:
    """Where `following` (the next call's prompt ids) leaves `prompt + response`; None when it
    continues them exactly, or does not continue this call at all (nothing is known then)."""
    expected = [*prompt, *response]
    shared = common_prefix(expected, following)
    if shared == len(expected):
        return None
    stops = bool(response) and response[-1] in codec.special
    if stops and shared == len(expected) - 1:
        return None  # the stop token left out: the server's text never held it
    spelled = expected[:-1] if stops else expected  # what a text client would send back
    extends_prompt = shared >= len(prompt) and len(following) > len(prompt)
    if not extends_prompt and not _continues_as_text(codec, spelled, following, shared):
        return None
    found = difference(codec, expected, following, shared)
    found["in"] = "response" if shared >= len(prompt) else "prompt"
    return found


def _continues_as_text(
    codec: Codec, expected: Sequence[int], following: Sequence[int], shared: int
) -> bool:
    """Whether `following` decodes to `expected`'s text and more: the same text, tokenized
    again. Only the tail after the shared ids is decoded (a few tokens before it too, so both
    texts start at one boundary), and of `following` at most twice as many tokens."""
    start = max(0, shared - _BACK)
    tail = len(expected) - start
    want = codec.decode(expected[start:])
    have = codec.decode(following[start : start + 2 * tail + _BACK])
    return have.startswith(want)


def call_drift(
    codec: Codec,
    call: GenerateCall,
    prompt: Sequence[int] | None,
    following: Sequence[int] | None,
) -> dict[str, Any] | None:
    """Both checks for one call (`prompt`: its full prompt ids; `following`: the next call's,
    None when there is none or it has no ids); None when nothing drifted or nothing is known."""
    found: dict[str, Any] = {}
    responses = [o.token_ids for o in call.outputs if o.token_ids]
    if prompt is not None and following is not None and responses:
        # With several outputs, the one the next prompt continues furthest is the one judged.
        best = max(responses, key=lambda r: common_prefix([*prompt, *r], following))
        prefix = prefix_drift(codec, prompt, best, following)
        if prefix is not None:
            found["prefix"] = prefix
    for position, response in enumerate(call.outputs):
        if response.token_ids:
            roundtrip = roundtrip_drift(codec, response.token_ids)
            if roundtrip is not None:
                found["roundtrip"] = {"output": position, **roundtrip}
                break
    return found or None


def full_prompt_texts(calls: Sequence[GenerateCall]) -> list[str | None]:
    """Each call's whole text prompt, prefix sharing undone (None where it has none)."""
    texts: list[str | None] = []
    for call in calls:
        prompt = call.prompt
        text = prompt.text if isinstance(prompt.text, str) else None
        shared = (prompt.prefix_len or {}).get("text")
        if text is not None and prompt.prefix_call is not None and shared is not None:
            ref = prompt.prefix_call
            base = texts[ref] if 0 <= ref < len(texts) else None
            first = calls[ref].outputs[0].text if base is not None and calls[ref].outputs else ""
            context = None if base is None else base + (first if isinstance(first, str) else "")
            text = None if context is None else context[:shared] + text
        texts.append(text)
    return texts


def known_prompt_ids(
    calls: Sequence[GenerateCall],
    full: Sequence[Sequence[int] | None],
    codecs: Sequence[Codec | None],
) -> list[Sequence[int] | None]:
    """The recorded prompt ids; for a call whose text prompt came back without them, in a
    dialect whose server encodes a text prompt as it is (completions), that text encoded as
    the server encodes it."""
    known = list(full)
    texts: list[str | None] | None = None
    for position, call in enumerate(calls):
        codec = codecs[position]
        if (
            known[position] is None
            and codec is not None
            and dialect_named(call.dialect).encodes_text_prompt
        ):
            texts = full_prompt_texts(calls) if texts is None else texts
            text = texts[position]
            if text is not None:
                known[position] = codec.encode_prompt(text)
    return known


def mark_drift(
    trajectory: Trajectory,
    full: Sequence[Sequence[int] | None],
    codecs: Sequence[Codec | None],
    on_drift: Callable[[str], None] | None = None,
) -> None:
    """Sets each drifting call's `drift` and the trajectory's `summary["drift_calls"]` (only
    when some call could be checked). `full`: each call's full prompt ids (prefix sharing
    undone); `codecs`: each call's tokenizer, None where the model's is unknown."""
    calls = trajectory.calls
    full = known_prompt_ids(calls, full, codecs)
    checked = drifting = 0
    for position, call in enumerate(calls):
        codec = codecs[position]
        if codec is None:
            continue
        following = None
        if position + 1 < len(calls) and codecs[position + 1] is codec:
            following = full[position + 1]
        call.drift = call_drift(codec, call, full[position], following)
        checked += any(o.token_ids for o in call.outputs)
        if call.drift is not None:
            drifting += 1
            if on_drift is not None:
                for kind in KINDS:
                    if kind in call.drift:
                        on_drift(kind)
    if checked:
        trajectory.summary["drift_calls"] = drifting
