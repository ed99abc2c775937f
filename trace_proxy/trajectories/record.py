"""The canonical record: the one contract between capture, assembly, the store and exporters.

Plain dataclasses, serialised with orjson, documented field by field in docs/record-schema.md.
Bump SCHEMA_VERSION on any change a reader would notice.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from trace_proxy import safejson

SCHEMA_VERSION = "trace-proxy.trajectory/3"
KEY_FIELDS = ("experiment", "step", "sample_index", "rollout_n", "validate", "trajectory_id")


@dataclass(slots=True)
class RolloutKey:
    """Where a call belongs; each field says in `sources` where its value came from."""

    project: str
    experiment: str
    step: int | None = None
    sample_index: int | None = None
    rollout_n: int | None = None
    validate: bool | None = None
    trajectory_id: str | None = None
    sample_hash: str | None = None  # inferred groups: hash of the first prompt
    sample_id: str | None = None  # the client's own id of the sample (verl's `uid`)
    sources: dict[str, str] = field(default_factory=dict)


class IdsText:
    """Token ids kept as the JSON text they arrived in, between its brackets, once decoding it
    has shown it is a list of ints: a sixth of the memory of the ints (36 bytes each) while a
    trajectory is open. `dumps` writes the text as it is; `ids_list` decodes it again.

    `base` and `more`, while a new call is assembled: the text this one was found to continue
    and the ids after it, decoded then, so that the assembler need not decode them again."""

    __slots__ = ("base", "count", "more", "text")

    def __init__(
        self, text: bytes, count: int, base: bytes | None = None, more: list[int] | None = None
    ) -> None:
        self.text = text
        self.count = count
        self.base = base
        self.more = more

    def decode(self) -> list[int]:
        ids: list[int] = orjson.loads(b"[" + self.text + b"]")
        return ids


TokenIds = list[int] | IdsText


def ids_text_tail(text: bytes, base: bytes) -> bytes | None:
    """When `text` is `base` followed by more items (both the JSON text of a list of ids,
    between its brackets): what follows `base`'s comma. Else None."""
    if not text.startswith(base):
        return None
    after = len(base)
    while text[after : after + 1] in (b" ", b"\t", b"\r", b"\n"):
        after += 1
    return text[after + 1 :] if text[after : after + 1] == b"," else None


def has_line_break(text: bytes) -> bool:
    """A record is one line of the store: ids written over several lines are not kept as
    text."""
    return b"\n" in text or b"\r" in text


def ids_list(ids: TokenIds | None) -> list[int] | None:
    return ids.decode() if isinstance(ids, IdsText) else ids


def ids_count(ids: TokenIds | None) -> int:
    if ids is None:
        return 0
    return ids.count if isinstance(ids, IdsText) else len(ids)


@dataclass(slots=True)
class Prompt:
    """What the model was asked. Exactly the fields the client (or server) supplied are set.

    When `prefix_call` is set, the prompt extends an earlier call of the same trajectory: the
    full value is the first `prefix_len` items of that call's context (its prompt followed by its
    first output, for token ids and text; its messages, for chat, followed by the assistant
    message `prefix_reply` rebuilds from one of its outputs when set) followed by what is stored
    here. `expand_prompts` rebuilds the full prompt.
    """

    token_ids: TokenIds | None = None  # an IdsText only in the capture process
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    prefix_call: int | None = None
    prefix_len: dict[str, int] | None = None
    prefix_reply: dict[str, Any] | None = None  # prompts.reply_reference


@dataclass(slots=True)
class Output:
    """One generated sequence (a choice); n > 1 gives several."""

    index: int
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    response_text: str | None = None  # token2text: the decoded token_ids


def output_text(output: Output) -> str:
    """The output's text to build on ("" when none). vLLM's legacy `/generate` answers with a
    list of texts, which the record keeps as it came and nothing builds on."""
    return output.text if isinstance(output.text, str) else ""


@dataclass(slots=True)
class CallError:
    type: str
    message: str


@dataclass(slots=True)
class GenerateCall:
    """One HTTP generate request and its response, as the server answered it."""

    index: int
    dialect: str
    route: str
    upstream: str
    start: float
    end: float | None
    first_byte: float | None = None
    http_status: int | None = None
    stream: bool = False
    request_id: str | None = None
    model: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt: Prompt = field(default_factory=Prompt)
    outputs: list[Output] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    weight_version: str | None = None
    error: CallError | None = None
    unparsed: str | None = None
    # Credentials redacted; None: the same as the previous call's (stored once per trajectory).
    request_headers: dict[str, str] | None = field(default_factory=dict)
    prompt_text: str | None = None  # token2text: the decoded prompt.token_ids (as stored)
    segments: list[dict[str, Any]] | None = None  # HTTP calls merged into this one (resumed)
    # token2text: where the ids trained on leave the ids generated (drift.py); None: no drift
    # found, or nothing could be checked.
    drift: dict[str, Any] | None = None
    kind: Literal["generate"] = "generate"


@dataclass(slots=True)
class ToolCall:
    """One tool execution inside a trajectory, and how the proxy came to know of it.

    `observed`: `chat_tool_calls` (a response's `tool_calls` matched by id to the next request's
    `role: tool` messages), `parsed_from_text` (tool-call markup parsed from decoded tokens, the
    result taken from the tokens the next prompt adds), or `http_tool_server` (an HTTP tool
    server routed through the proxy). Times are the agent's tool time: from the end of the
    response that asked for the call to the start of the request that carried its result.
    """

    index: int
    observed: str
    start: float
    end: float | None
    name: str | None = None
    call_id: str | None = None
    arguments: str | None = None
    result: str | None = None
    requested_by: int | None = None  # index of the generate call that asked for it
    error: CallError | None = None
    raw: str | None = None  # tool-call text that could not be parsed, kept as it was
    route: str | None = None  # http_tool_server only
    upstream: str | None = None
    http_status: int | None = None
    kind: Literal["tool"] = "tool"


# The step events after which calls are generated by new weights.
WEIGHT_UPDATE_EVENTS = frozenset({"weight_update", "weight_update_finish", "weight_version"})


@dataclass(slots=True)
class StepEvent:
    """A control call that matters to the whole step: weight update, pause, resume, ..."""

    event: str
    route: str
    upstream: str
    time: float
    project: str
    experiment: str
    http_status: int | None = None
    weight_version: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    error: CallError | None = None
    schema: str = SCHEMA_VERSION
    record: Literal["event"] = "event"


@dataclass(slots=True)
class Trajectory:
    """One rollout: every call of one (experiment, step, sample, rollout), in start order."""

    id: str
    key: RolloutKey
    start: float
    end: float
    status: Literal["ok", "error"]
    close_reason: str
    calls: list[GenerateCall]
    tools: list[ToolCall] = field(default_factory=list)
    transcript: str | None = None  # token2text: the last call's full prompt and response
    upstreams: list[str] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    # The oldest and newest policy version of any attempt of any call (see `version_span`),
    # and whether they differ: a rollout generated across a weight sync (verl's partial rollout).
    weight_version_min: str | None = None
    weight_version_max: str | None = None
    partial_rollout: bool = False
    # The newest policy version the proxy had seen in its run (calls, weight updates) when
    # the trajectory closed: how stale it already was (`versions.lag`).
    weight_version_latest: str | None = None
    annotations: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    score: float | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    part: int = 1
    summary: dict[str, int] = field(default_factory=dict)
    schema: str = SCHEMA_VERSION
    record: Literal["trajectory"] = "trajectory"


@dataclass(slots=True)
class StepSummary:
    """What one step produced and what was kept: written when the step ends."""

    project: str
    experiment: str
    step: int | None
    validate: bool
    trajectories_seen: int = 0
    trajectories_kept: int = 0
    trajectories_dropped_by_sampler: int = 0
    calls_seen: int = 0
    calls_kept: int = 0
    calls_dropped_by_sampler: int = 0
    schema: str = SCHEMA_VERSION
    record: Literal["step_summary"] = "step_summary"


@dataclass(slots=True)
class Annotation:
    """A reward, score or labels that arrived after its trajectory was exported (or for one
    this proxy never saw): readers apply it to the trajectories listed in `trajectories`."""

    project: str
    experiment: str
    step: int | None
    validate: bool
    target: dict[str, Any]  # what the caller named: trajectory_id, or key fields
    trajectories: list[str]  # record ids it applies to; empty when none is known here
    time: float
    reward: float | None = None
    score: float | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA_VERSION
    record: Literal["annotation"] = "annotation"


Record = Trajectory | StepEvent | StepSummary | Annotation


_ids = random.Random()  # seeded from the OS
os.register_at_fork(after_in_child=_ids.seed)  # a forked process must not repeat its parent's


RESTART_SOURCE = "capture_restart"


def restart_mark(since: float) -> dict[str, Any]:
    """The annotation of a trajectory first seen by a capture process that replaced one that
    died: its calls before that death are in this proxy's earlier record of it (one that
    started at or after `since`, when the proxy started), or were lost with that process
    (counted as `capture_process_lost`). Readers join the two (`store/restarts.py`)."""
    return {
        "field": "part", "source": RESTART_SOURCE, "value": since,
        "note": "begun after a capture process restart: earlier calls are in this proxy's "
                "previous record of it, or were lost",
    }  # fmt: skip


def new_record_id() -> str:
    """128 random bits in the shape of `uuid4().hex`, without a system call per id."""
    bits = _ids.getrandbits(128) & ~(0xF000 << 64) | (0x4000 << 64)  # version 4
    bits = bits & ~(0xC000 << 48) | (0x8000 << 48)  # RFC 4122 variant
    return f"{bits:032x}"


def dumps(record: Record) -> bytes:
    """One JSON line (without the newline). Never fails on what a request or a response
    held: strings that are not UTF-8 and nesting orjson cannot write are repaired in a copy
    (`safejson`), so one hostile call cannot keep a batch of records from the spool."""
    return safejson.dumps(record, default=_ids_fragment)


def _ids_fragment(value: Any) -> orjson.Fragment:
    if isinstance(value, IdsText):
        return orjson.Fragment(b"[" + value.text + b"]")
    raise TypeError(f"{type(value).__name__} is not part of a record")


_RECORD_TYPES: dict[str, type] = {
    "trajectory": Trajectory,
    "event": StepEvent,
    "step_summary": StepSummary,
    "annotation": Annotation,
}
# The nested dataclass fields of each record type: (field, type, is a list of it).
_NESTED: dict[type, tuple[tuple[str, type, bool], ...]] = {
    Trajectory: (("key", RolloutKey, False), ("calls", GenerateCall, True),
                 ("tools", ToolCall, True)),
    GenerateCall: (("prompt", Prompt, False), ("outputs", Output, True),
                   ("error", CallError, False)),
    ToolCall: (("error", CallError, False),),
    StepEvent: (("error", CallError, False),),
}  # fmt: skip


def _build(cls: type, data: dict[str, Any]) -> Any:
    for name, nested, many in _NESTED.get(cls, ()):
        value = data.get(name)
        if value is None:
            continue
        data[name] = [_build(nested, item) for item in value] if many else _build(nested, value)
    return cls(**data)


@dataclass(slots=True)
class SpooledTrajectory:
    """A trajectory's spool line with only its head decoded: what a backend that writes lines
    as they are (jsonl) needs when no processor would change the record. Decoding and encoding
    a whole trajectory again cost the export process more than writing it."""

    id: str
    key: RolloutKey
    start: float
    end: float
    line: bytes


_TRAJECTORY_TAIL = b',"schema":' + orjson.dumps(SCHEMA_VERSION) + b',"record":"trajectory"}'
_AFTER_HEAD = b',"status":'  # the field after id, key, start and end (no key field is named so)


def spooled_trajectory(line: bytes) -> SpooledTrajectory | None:
    """The head of a trajectory line of this schema; None for any other line."""
    if not line.startswith(b'{"id":') or not line.endswith(_TRAJECTORY_TAIL):
        return None
    end = line.find(_AFTER_HEAD)
    if end < 0:
        return None
    try:
        head = orjson.loads(line[:end] + b"}")
        return SpooledTrajectory(
            head["id"], RolloutKey(**head["key"]), head["start"], head["end"], line
        )
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None


def loads(line: bytes) -> Record:
    """The record a `dumps` line holds (the spool's way back from bytes to dataclasses).

    Raises ValueError for a line that is not a record of this schema.
    """
    data = orjson.loads(line)
    kind = data.get("record") if isinstance(data, dict) else None
    cls = _RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"not a trace-proxy record: {str(kind)[:40]!r}")
    try:
        record: Record = _build(cls, data)
    except TypeError as exc:
        raise ValueError(f"a {kind} record of another schema: {exc}") from None
    return record
