"""A recorded call's HTTP request, rebuilt from its record ("same inputs" replay).

The record keeps what a call asked: its route, model, stream flag, sampling parameters and its
whole prompt (messages and tools, text, or token ids; shared prefixes are expanded again). The
request is rebuilt from exactly those, in the shape its dialect sends them: token-in calls send
their recorded prompt ids, chat calls their messages. Request fields the record does not keep
(`tool_choice`, `stream_options`, `return_token_ids`, `chat_template_kwargs`, SGLang's top-level
`return_logprob`, ...) are not sent unless given again (`extra`), and a batch request (several
prompts in one body) is sent as one request per prompt, as it is recorded: one call each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trace_proxy.trajectories.prompts import expand_prompts

# vLLM's `/inference/v1/generate` fields that sit beside `sampling_params`; the record merges
# both into `sampling`, and every other one goes back into `sampling_params`.
GENERATE_TOP_LEVEL = frozenset({"cache_salt", "priority", "kv_transfer_params", "features"})
MODEL_DIALECTS = frozenset({"openai.chat", "openai.completions", "vllm.generate"})


@dataclass(frozen=True, slots=True)
class ReplayCall:
    """One request to send: the recorded call's position, route and body."""

    index: int
    path: str
    body: dict[str, Any]
    stream: bool


@dataclass(frozen=True, slots=True)
class NotReplayable:
    """A recorded call whose request cannot be rebuilt, and why."""

    index: int
    reason: str


def replay_calls(
    record: dict[str, Any], model: str | None = None, extra: dict[str, Any] | None = None
) -> list[ReplayCall | NotReplayable]:
    """The requests of a stored trajectory's generate calls, in call order. `model` replaces
    the model of each call that names one (every dialect but SGLang's `/generate`); `extra`
    fields are set at the top level of every body."""
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    prompts = expand_prompts({**record, "calls": calls})
    rebuilt: list[ReplayCall | NotReplayable] = []
    for position, (call, prompt) in enumerate(zip(calls, prompts, strict=True)):
        recorded = call.get("index")
        index = recorded if isinstance(recorded, int) else position
        rebuilt.append(_request(index, call, prompt, model, extra or {}))
    return rebuilt


def _request(
    index: int,
    call: dict[str, Any],
    prompt: dict[str, Any],
    model: str | None,
    extra: dict[str, Any],
) -> ReplayCall | NotReplayable:
    route = call.get("route")
    if not isinstance(route, str) or not route.startswith("/") or route.startswith("//"):
        return NotReplayable(index, f"no usable route recorded ({str(route)[:60]!r})")
    dialect = call.get("dialect")
    recorded = call.get("sampling")
    sampling: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    stream = call.get("stream") is True
    body = _body(dialect, sampling, prompt)
    if isinstance(body, str):
        unparsed = call.get("unparsed")
        if isinstance(unparsed, str):
            body = f"{body}: {unparsed[:160]}"
        return NotReplayable(index, body)
    named = model or call.get("model")
    if isinstance(named, str) and (dialect in MODEL_DIALECTS or call.get("model") is not None):
        body = {"model": named, **body}
    if stream:  # false is every dialect's default, and what a request without it meant
        body["stream"] = True
    body.update(extra)
    return ReplayCall(index, route, body, stream)


def _body(dialect: Any, sampling: dict[str, Any], prompt: dict[str, Any]) -> dict[str, Any] | str:
    """The dialect's body for this prompt and these parameters, or why there is none."""
    ids, text, messages = prompt.get("token_ids"), prompt.get("text"), prompt.get("messages")
    if dialect == "openai.chat":
        if not isinstance(messages, list):
            return "no messages recorded"
        tools = prompt.get("tools")
        return {"messages": messages, **({"tools": tools} if tools else {}), **sampling}
    if dialect == "openai.completions":
        # The client's own prompt: text when it sent text (ids may be the server's echo).
        if isinstance(text, str):
            return {"prompt": text, **sampling}
        if isinstance(ids, list) and ids:
            return {"prompt": ids, **sampling}
        return "no prompt recorded"
    if dialect == "vllm.generate":
        if not isinstance(ids, list) or not ids:
            return "no prompt token ids recorded"
        top = {k: v for k, v in sampling.items() if k in GENERATE_TOP_LEVEL}
        params = {k: v for k, v in sampling.items() if k not in GENERATE_TOP_LEVEL}
        return {"token_ids": ids, "sampling_params": params, **top}
    if dialect == "sglang.generate":
        if isinstance(ids, list) and ids:
            return {"input_ids": ids, "sampling_params": sampling}
        if isinstance(text, str):
            return {"text": text, "sampling_params": sampling}
        return "no prompt recorded"
    return f"the request was not understood when recorded (dialect {str(dialect)[:40]!r})"
