"""A recorded call's HTTP request, rebuilt from its record ("same inputs" replay).

The record keeps what a call asked: its route, model, stream flag, sampling parameters and its
whole prompt (messages and tools, text, or token ids; shared prefixes are expanded again). The
request is rebuilt from exactly those, in the shape its dialect sends them (the dialect's
declared `request`, `trajectories/dialects.py`): token-in calls send their recorded prompt ids,
chat calls their messages. Request fields the record does not keep
(`tool_choice`, `stream_options`, `return_token_ids`, `chat_template_kwargs`, SGLang's top-level
`return_logprob`, ...) are not sent unless given again (`extra`), and a batch request (several
prompts in one body) is sent as one request per prompt, as it is recorded: one call each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trace_proxy.trajectories.dialects import dialect_named
from trace_proxy.trajectories.prompts import expand_prompts


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
    declared = dialect_named(dialect)
    if declared.request is None:
        body: dict[str, Any] | str = (
            f"the request was not understood when recorded (dialect {str(dialect)[:40]!r})"
        )
    else:
        body = declared.request(sampling, prompt)
    if isinstance(body, str):
        unparsed = call.get("unparsed")
        if isinstance(unparsed, str):
            body = f"{body}: {unparsed[:160]}"
        return NotReplayable(index, body)
    named = model or call.get("model")
    if isinstance(named, str) and (declared.names_model or call.get("model") is not None):
        body = {"model": named, **body}
    if stream:  # false is every dialect's default, and what a request without it meant
        body["stream"] = True
    body.update(extra)
    return ReplayCall(index, route, body, stream)
