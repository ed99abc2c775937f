"""verl's `generate` as an HTTP request to its own server, and the answer as verl's TokenOutput.

What verl's vLLM and SGLang servers do with a `generate` Ray call (verl 0.9.1,
`vllm_async_server.py` `generate`, `async_sglang_server.py` `generate`) is redone here on the
client side, so that the HTTP path returns the same tokens, log probs and stop reason: the
default `max_tokens` (the response length, capped by what is left of prompt + response length
and by the model's context), `logprobs` as a flag, the server's `ignore_eos` and
`repetition_penalty`, and the mapping of finish reasons. Pure functions: no verl import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Sampling parameters verl's vLLM server hands to `SamplingParams` and vLLM's
# /v1/completions honours under the same name. Any other key goes through verl's own path:
# the HTTP server would accept it silently and ignore it.
VLLM_SAMPLING_KEYS = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "max_tokens", "max_new_tokens", "logprobs", "logit_bias", "allowed_token_ids",
        "bad_words", "truncate_prompt_tokens",
    }
)  # fmt: skip
# SGLang's /generate takes its sampling parameters as a dict, as verl's server passes them.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "sampling_seed", "stop", "stop_token_ids", "ignore_eos",
        "min_new_tokens", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "max_tokens", "max_new_tokens", "logprobs", "n",
    }
)  # fmt: skip


class UnexpectedAnswer(ValueError):
    """The server's answer is not what its API documents; verl's own path is used instead."""


@dataclass(frozen=True)
class ServerLimits:
    """What verl's server knows and the request must carry: from `actor_rollout_ref.rollout`."""

    engine: str  # "vllm" | "sglang"
    prompt_length: int
    response_length: int
    max_model_len: int
    ignore_eos: bool = False
    repetition_penalty: float = 1.0


@dataclass
class GenerateResult:
    """The parts of verl's TokenOutput an HTTP answer gives."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str | None
    num_cached_tokens: int | None = None


def unsupported_sampling(engine: str, sampling_params: dict[str, Any]) -> str | None:
    """The first sampling parameter the HTTP path cannot carry, or None."""
    known = VLLM_SAMPLING_KEYS if engine == "vllm" else SGLANG_SAMPLING_KEYS
    for name in sampling_params:
        if name not in known:
            return name
    return None


def _limit(sampling_params: dict[str, Any], first: str, second: str) -> Any:
    if first in sampling_params:
        return sampling_params.pop(first)
    if second in sampling_params:
        return sampling_params.pop(second)
    return None


def vllm_request(
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    limits: ServerLimits,
    *,
    request_id: str,
    priority: int = 0,
) -> dict[str, Any]:
    """The /v1/completions body for what verl's vLLM server would run (token ids in and out)."""
    params = dict(sampling_params)
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"Prompt length ({len(prompt_ids)}) leaves no room to generate within the model's "
            f"maximum context length ({limits.max_model_len}); need at least 1 token of headroom."
        )
    max_tokens = _limit(params, "max_tokens", "max_new_tokens")
    if max_tokens is None:
        max_tokens = min(
            limits.response_length,
            limits.prompt_length + limits.response_length - len(prompt_ids),
        )
    max_tokens = max(1, min(int(max_tokens), room))
    params["logprobs"] = 0 if params.pop("logprobs", False) else None
    params.setdefault("repetition_penalty", limits.repetition_penalty)
    params.setdefault("ignore_eos", limits.ignore_eos)
    body: dict[str, Any] = {
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        **params,
        "return_token_ids": True,
        "request_id": request_id,
    }
    if priority:
        body["priority"] = priority
    return body


def vllm_result(answer: Any) -> GenerateResult:
    """verl's reading of a finished vLLM request, from the /v1/completions answer."""
    try:
        choice = answer["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs")
        log_probs = None
        if logprobs is not None:
            log_probs = [float(x) for x in logprobs["token_logprobs"]]
            if len(log_probs) != len(token_ids):
                raise UnexpectedAnswer("token_logprobs and token_ids differ in length")
        finish = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        if isinstance(exc, UnexpectedAnswer):
            raise
        raise UnexpectedAnswer(f"not a vLLM completion with token ids: {exc!r}") from None
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return GenerateResult(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason=vllm_stop_reason(finish),
        num_cached_tokens=cached if isinstance(cached, int) else None,
    )


def vllm_stop_reason(finish_reason: str | None) -> str | None:
    """verl's mapping: stop and length complete, abort is aborted, the rest kept as is."""
    if finish_reason == "abort":
        return "aborted"
    if finish_reason in ("stop", "length"):
        return "completed"
    return finish_reason


def sglang_request(
    prompt_ids: list[int], sampling_params: dict[str, Any], limits: ServerLimits, *, request_id: str
) -> dict[str, Any]:
    """The /generate body for what verl's SGLang server would run."""
    params = dict(sampling_params)
    room = limits.max_model_len - len(prompt_ids) - 1
    if room < 0:
        raise ValueError(
            f"Prompt length ({len(prompt_ids)}) exceeds the model's maximum context length "
            f"({limits.max_model_len})."
        )
    max_new_tokens = _limit(params, "max_new_tokens", "max_tokens")
    if max_new_tokens is None:
        max_new_tokens = min(
            limits.response_length,
            limits.prompt_length + limits.response_length - len(prompt_ids),
        )
    params["max_new_tokens"] = max(0, min(int(max_new_tokens), room))
    return_logprob = bool(params.pop("logprobs", False))
    return {
        "rid": request_id,
        "input_ids": list(prompt_ids),
        "sampling_params": params,
        "return_logprob": return_logprob,
    }


def sglang_result(answer: Any, return_logprob: bool) -> GenerateResult:
    """verl's reading of SGLang's answer: the finish reason's type as the stop reason."""
    try:
        meta = answer.get("meta_info") or {}
        finish = meta.get("finish_reason")
        stop_reason = finish["type"] if finish else None
        token_ids = [int(t) for t in answer.get("output_ids") or []]
        log_probs: list[float] | None = None
        if return_logprob:
            pairs = meta.get("output_token_logprobs") or []
            if pairs and len(pairs) == len(token_ids):
                log_probs = [float(entry[0]) for entry in pairs]
            else:  # verl drops the tokens when the lengths disagree
                token_ids, log_probs = [], []
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise UnexpectedAnswer(f"not an SGLang /generate answer: {exc!r}") from None
    return GenerateResult(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason)
