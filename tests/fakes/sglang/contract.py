"""The `/generate` request contract: the schema gate SGLang runs before anything else.

Follows sglang 0.5.23 `srt/entrypoints/api_contract.py`, which decodes a body with the
generated `GenerateRequest.from_json_value` (`api/v1/api_types.py`, from the schema in
`proto/sglang/api/v1`) and refuses it with the decoder's serde-style text. The fake checks the
common fields the same way: their types, the sampling parameters' names, nulls where allowed.
"""

from __future__ import annotations

from typing import Any

SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip


class ContractError(ValueError):
    """A `/generate` body the schema gate rejects: 400 `{"error": "<serde-style text>"}`."""


def _unexpected(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _expect(ok: bool, value: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sampling(value: Any) -> None:
    _expect(isinstance(value, dict), value, "struct SamplingParams")
    for key, item in value.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if item is None:
            continue
        if key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed"):
            _expect(_is_int(item), item, "i64")
        elif key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
            _expect(isinstance(item, (int, float)) and not isinstance(item, bool), item, "f64")
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            _expect(isinstance(item, bool), item, "a boolean")
        elif key == "stop":
            _check_string_or_list(item, "StringOrList")
        elif key == "stop_token_ids":
            _expect(isinstance(item, list), item, "a sequence")
            for token in item:
                _expect(_is_int(token), token, "i64")


def _check_string_or_list(value: Any, name: str) -> None:
    if isinstance(value, list):
        for item in value:
            _expect(isinstance(item, str), item, "a string")
    else:
        _expect(isinstance(value, str), value, f"a value or an array of values for {name}")


def contract_error(body: Any) -> str | None:
    """The schema gate (`sglang.api.v1.GenerateRequest.from_json_value`) for common fields."""
    try:
        _expect(isinstance(body, dict), body, "struct GenerateRequest")
        for key in ("rid", "text"):
            if body.get(key) is not None:
                _check_string_or_list(body[key], "StringOrList")
        ids = body.get("input_ids")
        if ids is not None:
            _expect(isinstance(ids, list), ids, "a value or an array of values for TokenIdsOrList")
            rows = [ids] if not ids or not isinstance(ids[0], list) else ids
            for row in rows:
                _expect(isinstance(row, list), row, "a sequence")
                for token in row:
                    _expect(_is_int(token), token, "i64")
        if body.get("stream") is not None:
            _expect(isinstance(body["stream"], bool), body["stream"], "a boolean")
        params = body.get("sampling_params")
        if params is not None:
            for item in params if isinstance(params, list) else [params]:
                _check_sampling(item)
        for key in ("return_logprob",):
            value = body.get(key)
            for item in value if isinstance(value, list) else [value]:
                if item is not None:
                    _expect(isinstance(item, bool), item, "a boolean")
        for key in ("logprob_start_len", "top_logprobs_num"):
            value = body.get(key)
            for item in value if isinstance(value, list) else [value]:
                if item is not None:
                    _expect(_is_int(item), item, "i64")
        if "return_prompt_token_ids" in body:  # not nullable in the schema
            value = body["return_prompt_token_ids"]
            _expect(isinstance(value, bool), value, "a boolean")
        if body.get("return_text_in_logprobs") is not None:
            value = body["return_text_in_logprobs"]
            _expect(isinstance(value, bool), value, "a boolean")
    except ContractError as exc:
        return str(exc)
    return None
