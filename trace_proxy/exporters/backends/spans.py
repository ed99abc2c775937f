"""One neutral view of a trajectory's spans, built once, that each trace backend maps.

MLflow, OpenTelemetry, trackio and Weave draw a trajectory the same way: a root span for the
rollout, a generate span per call and a tool span per tool call, both kinds children of the
root, in the record's order. What the spans hold is the same too, so it is built here once:
times; each call's whole prompt (prefix sharing undone by `expand_prompts`), its token count
and its whole decoded text; outputs, usage, error; each tool's name, arguments, result. A
backend keeps only its own mapping: names, attributes, span kinds, how a span without an end
ends. The view reads a trajectory's JSON form (as the store holds it) or the record itself,
sharing its values rather than copying them; the whole prompts' token ids, a copy of the
context per call, are built only when asked for (`prompt_ids`).

Times stay the record's epoch seconds. `ns` turns one into integer nanoseconds, the float's
exact value to the nearest ns (`seconds * 1e9` is off by up to 256 ns at today's epoch; the
fraction alone is exact), as OTLP spans carry it. MLflow's spans keep their own rounding to the
whole microsecond, which that backend's tests pin.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

import orjson

from trace_proxy.trajectories import versions
from trace_proxy.trajectories.dialects import Dialect, dialect_named
from trace_proxy.trajectories.prompts import (
    expand_prompts,
    prompt_texts,
    prompt_token_counts,
    transcript_of,
)
from trace_proxy.trajectories.record import GenerateCall, Trajectory, ids_list

JSON = dict[str, Any]
ROOT = "root"
# The root span's name in every backend: the rollout, named as verl's rollout trace names it.
ROOT_NAME = "agent_loop"


@dataclass(frozen=True, slots=True)
class Root:
    """The rollout as a whole: its key, outcome and times (the root span)."""

    record_id: str
    key: JSON
    start: float
    end: float
    status: str | None  # "ok" or "error"
    close_reason: str | None
    part: int | None  # the record's part of a trajectory cut in several
    reward: Any
    score: Any
    labels: Any
    upstreams: Any
    weight_versions: Any
    annotations: Any
    summary: Any
    transcript: str | None  # the whole decoded conversation: stored, else from the pieces
    transcript_stored: bool  # stored because the decoded pieces do not spell it out
    # Asynchronous RL: which policy versions generated it and how stale it was at close.
    weight_version_min: str | None = None
    weight_version_max: str | None = None
    weight_version_latest: str | None = None
    partial_rollout: bool = False
    version_spread: int | None = None  # `versions.spread`
    version_lag: int | None = None  # `versions.lag`
    id: str = ROOT
    parent: str | None = None

    def policy_fields(self) -> JSON:
        """What every backend's trajectory metadata says of its policy versions, named as
        the record names them (`version_spread`, `version_lag`: `trajectories/versions.py`)."""
        return {
            "sample_id": self.key.get("sample_id"),
            "weight_version_min": self.weight_version_min,
            "weight_version_max": self.weight_version_max,
            "weight_version_latest": self.weight_version_latest,
            "partial_rollout": self.partial_rollout,
            "version_spread": self.version_spread,
            "version_lag": self.version_lag,
        }

    def lag_of(self, call: Generation) -> int | None:
        """How many versions behind the newest at close the weights of `call` were."""
        return versions.distance(call.weight_version, self.weight_version_latest)


@dataclass(frozen=True, slots=True)
class Generation:
    """One generate call: `prompt` is its whole prompt, `stored_prompt` what the record holds
    (after a shared prefix: the rest, with `prefix_call` and `prefix_len`)."""

    id: str  # "call/<index>": what a backend derives the span's id from
    index: int
    start: float
    end: float | None
    first_byte: float | None
    dialect: str | None
    route: str | None
    upstream: str | None
    model: str | None
    request_id: str | None
    http_status: int | None
    stream: Any
    sampling: Any
    usage: Any
    weight_version: str | None
    segments: Any
    unparsed: str | None
    error: JSON | None
    outputs: list[JSON]
    prompt: JSON  # its messages, text and tools (its token ids: `TrajectorySpans.prompt_ids`)
    prompt_tokens: int  # how many token ids the whole prompt has
    stored_prompt: JSON
    prompt_piece: str | None  # token2text's decoding of the stored token ids
    prompt_text: str | None  # the whole prompt decoded, where the pieces spell it out
    parent: str = ROOT

    @property
    def declared(self) -> Dialect:
        """Its dialect's declaration: whether it is chat, what each backend names it."""
        return dialect_named(self.dialect)


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool call; `end` is None when it was never answered."""

    id: str  # "tool/<index>"
    index: int
    observed: str | None
    start: float
    end: float | None
    name: str | None
    call_id: str | None
    arguments: str | None  # as the model wrote them
    parsed_arguments: Any  # their JSON value; the text as it is when it is not JSON
    result: str | None
    requested_by: int | None  # the position of the generate call that asked for it
    error: JSON | None
    raw: str | None
    route: str | None
    upstream: str | None
    http_status: int | None
    parent: str = ROOT


@dataclass(frozen=True, slots=True)
class TrajectorySpans:
    root: Root
    calls: tuple[Generation, ...]
    tools: tuple[Tool, ...]

    @property
    def failed(self) -> list[Generation]:
        """The calls that failed, in order."""
        return [call for call in self.calls if call.error]

    def __iter__(self) -> Iterator[Root | Generation | Tool]:
        """Every span in drawing order: the root, the calls, the tools."""
        yield self.root
        yield from self.calls
        yield from self.tools

    def prompt_ids(self) -> list[list[int] | None]:
        """Each call's whole prompt token ids: a copy of the context per call, so they are
        built only for a backend that sends them."""
        stored = [{"prompt": c.stored_prompt, "outputs": c.outputs} for c in self.calls]
        return [prompt.get("token_ids") for prompt in expand_prompts({"calls": stored})]


def trajectory_spans(record: Trajectory | JSON) -> TrajectorySpans:
    """The spans of a trajectory, given as its JSON form (`orjson.loads(dumps(trajectory))`,
    as the store holds it) or as the record itself (its fields read where they are: no copy,
    no decoding of its token ids)."""
    data = _fields_of(record) if isinstance(record, Trajectory) else record
    calls: list[JSON] = data.get("calls") or []
    prompts = _whole_prompts(calls)
    counts = prompt_token_counts(calls)
    texts = prompt_texts(calls, counts)
    root = Root(
        record_id=data["id"],
        key=data.get("key") or {},
        start=data["start"],
        end=data["end"],
        status=data.get("status"),
        close_reason=data.get("close_reason"),
        part=data.get("part"),
        reward=data.get("reward"),
        score=data.get("score"),
        labels=data.get("labels"),
        upstreams=data.get("upstreams"),
        weight_versions=data.get("weight_versions"),
        annotations=data.get("annotations"),
        summary=data.get("summary"),
        transcript=transcript_of(data),
        transcript_stored=data.get("transcript") is not None,
        weight_version_min=data.get("weight_version_min"),
        weight_version_max=data.get("weight_version_max"),
        weight_version_latest=data.get("weight_version_latest"),
        partial_rollout=bool(data.get("partial_rollout")),
        version_spread=versions.spread(data),
        version_lag=versions.lag(data),
    )
    generations = tuple(
        _generation(position, *parts)
        for position, parts in enumerate(zip(calls, prompts, counts, texts, strict=True))
    )
    tools = tuple(_tool(position, tool) for position, tool in enumerate(data.get("tools") or []))
    return TrajectorySpans(root, generations, tools)


# What a span takes from the record as it is (None when the record lacks it).
_CALL_FIELDS = ("end", "first_byte", "dialect", "route", "upstream", "model", "request_id",
                "http_status", "stream", "sampling", "usage", "weight_version", "segments",
                "unparsed", "error")  # fmt: skip
_TOOL_FIELDS = ("observed", "end", "name", "call_id", "arguments", "result", "requested_by",
                "error", "raw", "route", "upstream", "http_status")  # fmt: skip


def _generation(
    position: int, call: JSON, prompt: JSON, tokens: int, text: str | None
) -> Generation:
    index = call.get("index", position)
    return Generation(
        id=f"call/{index}",
        index=index,
        start=call["start"],
        outputs=call.get("outputs") or [],
        prompt=prompt,
        prompt_tokens=tokens,
        stored_prompt=call.get("prompt") or {},
        prompt_piece=call.get("prompt_text"),
        prompt_text=text,
        **_taken(call, _CALL_FIELDS),
    )


def _tool(position: int, tool: JSON) -> Tool:
    index = tool.get("index", position)
    arguments = tool.get("arguments")
    try:
        parsed: Any = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        parsed = arguments
    return Tool(
        id=f"tool/{index}",
        index=index,
        start=tool["start"],
        parsed_arguments=parsed,
        **_taken(tool, _TOOL_FIELDS),
    )


def _taken(data: JSON, names: tuple[str, ...]) -> JSON:
    return {name: data.get(name) for name in names}


def _fields_of(trajectory: Trajectory) -> JSON:
    """A trajectory's fields as its JSON form names them, the values shared, not copied."""
    data = _plain(trajectory)
    data["key"] = _plain(trajectory.key)
    data["calls"] = [_call_fields(call) for call in trajectory.calls]
    data["tools"] = [
        {**_plain(tool), "error": _plain(tool.error) if tool.error else None}
        for tool in trajectory.tools
    ]
    return data


def _call_fields(call: GenerateCall) -> JSON:
    prompt = _plain(call.prompt)
    prompt["token_ids"] = ids_list(call.prompt.token_ids)
    return {
        **_plain(call),
        "prompt": prompt,
        "outputs": [_plain(output) for output in call.outputs],
        "error": _plain(call.error) if call.error else None,
    }


def _plain(value: Any) -> JSON:
    return {field.name: getattr(value, field.name) for field in fields(value)}


def _whole_prompts(calls: list[JSON]) -> list[JSON]:
    """Each call's whole prompt but its token ids (`expand_prompts` on what it reads, without
    the ids: they are counted apart, `prompt_token_counts`)."""
    stored = [
        {
            "prompt": {k: v for k, v in (call.get("prompt") or {}).items() if k != "token_ids"},
            "outputs": [
                {k: v for k, v in output.items() if k != "token_ids"}
                for output in call.get("outputs") or []
            ],
        }
        for call in calls
    ]
    prompts = expand_prompts({"calls": stored})
    for prompt in prompts:
        prompt.pop("token_ids", None)
    return prompts


def error_text(error: JSON | None) -> str | None:
    """`type: message` of a call's or tool's error."""
    if not error:
        return None
    return f"{error.get('type')}: {error.get('message')}"


def ns(seconds: float) -> int:
    """Epoch seconds to integer nanoseconds: the float's exact value to the nearest ns."""
    whole = int(seconds)
    return whole * 1_000_000_000 + round((seconds - whole) * 1e9)


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def duration_ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000.0, 3)
