"""The API dialects a generate call can be recorded in, each declared once: its name (a call's
`dialect` in the record), its routes, where a request keeps its prompt's token ids, what the
backends call it, and how a recorded call is sent again.

Capture parses a dialect's responses in `capture/dialects/<module>.py`, which names its
declaration here; replay, drift and every backend read only this table. Adding a dialect is a
declaration in `DECLARED` and a parser module in `capture/dialects/` (found there, not listed);
`tests/trajectories/test_dialect_declarations.py` fails when any piece is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Body = dict[str, Any]
# A recorded call's body from its sampling parameters and its whole prompt (`prompt` in the
# record, shared prefixes expanded), or why there is none.
Request = Callable[[Mapping[str, Any], Mapping[str, Any]], Body | str]


@dataclass(frozen=True, slots=True)
class Operations:
    """What each backend calls one generate call of a dialect (its span's or op's name)."""

    gen_ai: str  # OpenTelemetry GenAI `gen_ai.operation.name` (otlp)
    trackio: str  # the generation span's name (trackio)
    weave: str  # the child call's op (weave)


@dataclass(frozen=True, slots=True)
class Dialect:
    """Everything about one dialect that the proxy's parts other than its parser need."""

    name: str  # a call's `dialect` in the record
    routes: tuple[str, ...]  # the request paths that speak it
    prompt_ids: str | None  # the request field that may hold the prompt's token ids
    chat: bool  # messages in, an assistant message out
    names_model: bool  # a request names its model (replay's `--model` replaces it)
    # The server encodes a text prompt as it is (no template), so drift may encode one whose
    # ids the record lacks (`drift.known_prompt_ids`).
    encodes_text_prompt: bool
    provider: str | None  # the server it belongs to (`gen_ai.provider.name`); None: several
    operations: Operations
    request: Request | None  # how a recorded call is sent again (replay)


def _chat_request(sampling: Mapping[str, Any], prompt: Mapping[str, Any]) -> Body | str:
    messages = prompt.get("messages")
    if not isinstance(messages, list):
        return "no messages recorded"
    tools = prompt.get("tools")
    return {"messages": messages, **({"tools": tools} if tools else {}), **sampling}


def _completions_request(sampling: Mapping[str, Any], prompt: Mapping[str, Any]) -> Body | str:
    # The client's own prompt: text when it sent text (ids may be the server's echo).
    ids, text = prompt.get("token_ids"), prompt.get("text")
    if isinstance(text, str):
        return {"prompt": text, **sampling}
    if isinstance(ids, list) and ids:
        return {"prompt": ids, **sampling}
    return "no prompt recorded"


# vLLM's `/inference/v1/generate` fields that sit beside `sampling_params`; the record merges
# both into `sampling`, and every other one goes back into `sampling_params`.
GENERATE_TOP_LEVEL = frozenset({"cache_salt", "priority", "kv_transfer_params", "features"})


def _vllm_generate_request(sampling: Mapping[str, Any], prompt: Mapping[str, Any]) -> Body | str:
    ids = prompt.get("token_ids")
    if not isinstance(ids, list) or not ids:
        return "no prompt token ids recorded"
    top = {k: v for k, v in sampling.items() if k in GENERATE_TOP_LEVEL}
    params = {k: v for k, v in sampling.items() if k not in GENERATE_TOP_LEVEL}
    return {"token_ids": ids, "sampling_params": params, **top}


def _sglang_generate_request(sampling: Mapping[str, Any], prompt: Mapping[str, Any]) -> Body | str:
    ids, text = prompt.get("token_ids"), prompt.get("text")
    if isinstance(ids, list) and ids:
        return {"input_ids": ids, "sampling_params": sampling}
    if isinstance(text, str):
        return {"text": text, "sampling_params": sampling}
    return "no prompt recorded"


OPENAI_CHAT = Dialect(
    name="openai.chat",
    routes=("/v1/chat/completions",),
    prompt_ids=None,
    chat=True,
    names_model=True,
    encodes_text_prompt=False,
    provider=None,
    operations=Operations(gen_ai="chat", trackio="chat", weave="chat"),
    request=_chat_request,
)
OPENAI_COMPLETIONS = Dialect(
    name="openai.completions",
    routes=("/v1/completions",),
    prompt_ids="prompt",
    chat=False,
    names_model=True,
    encodes_text_prompt=True,
    provider=None,
    operations=Operations(gen_ai="text_completion", trackio="text_completion", weave="completions"),
    request=_completions_request,
)
VLLM_GENERATE = Dialect(
    name="vllm.generate",
    routes=("/inference/v1/generate",),
    prompt_ids="token_ids",
    chat=False,
    names_model=True,
    encodes_text_prompt=False,
    provider="vllm",
    operations=Operations(gen_ai="text_completion", trackio="generate", weave="generate"),
    request=_vllm_generate_request,
)
SGLANG_GENERATE = Dialect(
    name="sglang.generate",
    routes=("/generate",),
    prompt_ids="input_ids",
    chat=False,
    names_model=False,
    encodes_text_prompt=False,
    provider="sglang",
    operations=Operations(gen_ai="text_completion", trackio="generate", weave="generate"),
    request=_sglang_generate_request,
)
DECLARED = (OPENAI_CHAT, OPENAI_COMPLETIONS, VLLM_GENERATE, SGLANG_GENERATE)

# A call whose dialect is none of these (a record from elsewhere): named as a generate, sent
# again never.
UNDECLARED = Dialect(
    name="",
    routes=(),
    prompt_ids=None,
    chat=False,
    names_model=False,
    encodes_text_prompt=False,
    provider=None,
    operations=Operations(gen_ai="text_completion", trackio="generate", weave="generate"),
    request=None,
)

BY_NAME: Mapping[str, Dialect] = {dialect.name: dialect for dialect in DECLARED}


def dialect_named(name: object) -> Dialect:
    """The declaration a record's `dialect` names; `UNDECLARED` for any other value."""
    return BY_NAME.get(name, UNDECLARED) if isinstance(name, str) else UNDECLARED
