"""An open trajectory, and the record built from it when it closes: prompt ids shared between
calls as they arrive, resumed generates merged, the annotations a record carries.

The assembler (`assembler.py`) decides which calls belong together and when a trajectory
closes; this module holds what one trajectory is while open and how it becomes a `Trajectory`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import orjson

from trace_proxy.trajectories.prompts import MIN_SHARED, extension, share_prefixes
from trace_proxy.trajectories.record import (
    GenerateCall,
    IdsText,
    RolloutKey,
    TokenIds,
    ToolCall,
    Trajectory,
    has_line_break,
    ids_count,
    ids_list,
    ids_text_tail,
    output_text,
)
from trace_proxy.trajectories.rewards import Outcome
from trace_proxy.trajectories.tools import chat_tool_spans
from trace_proxy.trajectories.versions import newer

IdsShared = tuple[GenerateCall, int, int]


@dataclass
class OpenTrajectory:
    id: str
    key: RolloutKey
    part: int
    last_activity: float
    calls: list[GenerateCall] = field(default_factory=list)
    tools: list[ToolCall] = field(default_factory=list)  # seen directly (HTTP tool servers)
    annotations: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)  # rewards posted while open
    dropped: int = 0  # calls forwarded whose bodies capture could not keep
    dropped_span: tuple[float, float] | None = None  # their earliest start and latest end
    units: int = 0  # exchanges' units it holds (calls, merged resumes, tool calls: ledger.py)
    # The newest policy version its run had seen when it closed (`Assembler`'s, set at close).
    weight_version_latest: str | None = None
    # Prompt ids are shared as calls arrive (see `share_ids`): the call that started last (the
    # last added of those that started together) and its full prompt ids, as the JSON text they
    # were decoded from when known (about a sixth of the memory of ints), else as a list; for
    # each later call, by id(): (the call it extends, ids shared, its full length).
    latest: GenerateCall | None = None
    latest_ids: list[int] | None = None
    latest_text: bytes | None = None
    latest_count: int = 0  # how many ids latest_text holds
    extends: dict[int, IdsShared] = field(default_factory=dict)

    def full_latest_ids(self) -> list[int] | None:
        if self.latest_text is not None:
            return IdsText(self.latest_text, self.latest_count).decode()
        return self.latest_ids


def sample_group(key: RolloutKey) -> Hashable | None:
    """The rollouts that share a first prompt: one sample of one step."""
    if key.sample_index is None:
        return None
    return (key.project, key.experiment, key.step, bool(key.validate), key.sample_index)


def share_ids(
    trajectory: OpenTrajectory, latest: GenerateCall | None, call: GenerateCall, text: bytes | None
) -> None:
    """Store a new call's prompt ids as what follows the latest call's context, as it arrives:
    an open trajectory then holds one full prompt, not one per turn (32k-id prompts take about
    1.2 MB each as Python ints). `build_trajectory` turns this into the record's prefix
    references, or undoes it when calls turned out to have started in another order."""
    prompt = call.prompt.token_ids  # a new call's: a list, or text whose ids were checked
    known: tuple[bytes | None, list[int] | None] = (None, None)
    if isinstance(prompt, IdsText):  # what decoding its request found, taken once
        known, prompt.base, prompt.more = (prompt.base, prompt.more), None, None
    if latest is not None and call.start < latest.start:
        return  # an earlier start arriving late: left whole, sorted out at build
    if latest is not None and prompt is not None:
        first = latest.outputs[0] if latest.outputs else None
        output = first.token_ids if first else None
        count = trajectory.latest_count
        tail = _tail(prompt, text, trajectory.latest_text, count, known)
        if tail is not None:
            # The same JSON text, then a comma: the same ids, without comparing them one by one.
            shared = count + extension((), output, tail)
            rest = tail[shared - count :]
        else:
            ids = ids_list(prompt) or []
            base = trajectory.full_latest_ids()
            shared = extension(base, output, ids) if base else 0
            rest = ids[shared:]
        trajectory.extends[id(call)] = (latest, shared, ids_count(prompt))
        if shared >= MIN_SHARED["token_ids"]:
            call.prompt.token_ids = rest
    trajectory.latest = call
    if text is None or prompt is None:
        trajectory.latest_ids, trajectory.latest_text, trajectory.latest_count = (
            ids_list(prompt), None, 0
        )  # fmt: skip
        return
    trajectory.latest_ids, trajectory.latest_text = None, text
    trajectory.latest_count = ids_count(prompt)
    if call.prompt.token_ids is prompt and isinstance(prompt, list) and not has_line_break(text):
        call.prompt.token_ids = IdsText(text, len(prompt))  # kept whole (a first prompt): as text


def _tail(
    prompt: TokenIds,
    text: bytes | None,
    base: bytes | None,
    count: int,
    known: tuple[bytes | None, list[int] | None] = (None, None),
) -> list[int] | None:
    """The ids after the latest prompt's `count` when `text` is that prompt's text (`base`)
    followed by more ids; else None. `known`: the text the request was found to continue when
    it was decoded, and the ids after it (those, when it is `base` itself)."""
    if not count or text is None or base is None:
        return None
    if known[0] is base and known[1] is not None and text is not base:
        return known[1]
    after = ids_text_tail(text, base)
    if after is None:
        return None
    if isinstance(prompt, IdsText):
        more: list[int] = orjson.loads(b"[" + after + b"]")
        return more
    return prompt[count:]


def _check_arrival_order(calls: list[GenerateCall], extends: dict[int, IdsShared]) -> None:
    """Keep `extends` while they describe `calls` in start order (each call extends the one
    before it); else give every prompt its full ids back and forget them."""
    previous: GenerateCall | None = None
    in_order = True
    for call in calls:
        found = extends.get(id(call))
        if call.prompt.token_ids is not None and previous is not None:
            in_order = in_order and found is not None and found[0] is previous
        previous = call
    if in_order:
        return
    full: dict[int, list[int] | None] = {}
    for call in calls:  # start order: what a call extends comes before it
        ids = ids_list(call.prompt.token_ids)
        found = extends.get(id(call))
        if found is not None and ids is not None and found[1] >= MIN_SHARED["token_ids"]:
            base, shared, _ = found
            first = base.outputs[0].token_ids if base.outputs else None
            ids = [*(full[id(base)] or ()), *(first or ())][:shared] + ids
        call.prompt.token_ids = ids  # lists again, for `share_prefixes` to compare
        full[id(call)] = ids
    extends.clear()


def build_trajectory(
    open_: OpenTrajectory, reason: str, notes: list[dict[str, Any]] | None = None
) -> Trajectory:
    """The record of a closed trajectory; `notes` are added to its annotations (what the
    store says of its key's names, say)."""
    calls = sorted(open_.calls, key=lambda c: c.start)
    for index, call in enumerate(calls):
        call.index = index
    extends = open_.extends
    _check_arrival_order(calls, extends)
    tools = sorted([*open_.tools, *chat_tool_spans(calls)], key=lambda t: t.start)
    for index, tool in enumerate(tools):
        tool.index = index
    prompt_tokens = completion_tokens = 0
    for call in calls:
        usage = call.usage or {}
        found = extends.get(id(call))
        prompt_ids = found[2] if found is not None else ids_count(call.prompt.token_ids)
        prompt_tokens += _tokens(usage.get("prompt_tokens"), prompt_ids)
        completion_tokens += _tokens(
            usage.get("completion_tokens"), sum(len(o.token_ids or ()) for o in call.outputs)
        )
    share_prefixes(calls, {key: (base, shared) for key, (base, shared, _) in extends.items()})
    _store_once(calls)
    errors = sum(1 for c in calls if c.error is not None)
    low, high = version_span(calls)
    reward = score = None
    labels: dict[str, Any] = {}
    for outcome in open_.outcomes:  # later posts win
        reward = outcome.reward if outcome.reward is not None else reward
        score = outcome.score if outcome.score is not None else score
        labels.update(outcome.labels)
    times = [c.start for c in calls] + [t.start for t in tools]
    ends = [c.end or c.start for c in calls] + [t.end or t.start for t in tools]
    if open_.dropped_span is not None:
        times.append(open_.dropped_span[0])
        ends.append(open_.dropped_span[1])
    return Trajectory(
        id=open_.id,
        key=open_.key,
        start=min(times),
        end=max(ends),
        status="error" if errors else "ok",
        close_reason=reason,
        calls=calls,
        tools=tools,
        upstreams=list(dict.fromkeys(c.upstream for c in calls)),
        weight_versions=[v for v in dict.fromkeys(c.weight_version for c in calls) if v],
        weight_version_min=low,
        weight_version_max=high,
        partial_rollout=low != high,
        weight_version_latest=newer(open_.weight_version_latest, high),
        annotations=open_.annotations + (notes or []),
        reward=reward,
        score=score,
        labels=labels,
        part=open_.part,
        summary={
            "calls": len(calls),
            "errors": errors,
            "unparsed": sum(1 for c in calls if c.unparsed is not None),
            "tool_calls": len(tools),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "calls_dropped": open_.dropped,
        },
    )


def _store_once(calls: list[GenerateCall]) -> None:
    """Headers every turn repeats are kept on the first call only; null usage entries go."""
    previous: dict[str, str] | None = None
    for call in calls:
        current = call.request_headers
        if current is not None and current == previous:
            call.request_headers = None
        previous = current
        if call.usage:
            call.usage = {k: v for k, v in call.usage.items() if v is not None}


def awaits_resume(trajectory: OpenTrajectory) -> bool:
    if not trajectory.calls:
        return False
    latest = max(trajectory.calls, key=lambda c: c.start)
    return bool(latest.outputs) and latest.outputs[0].finish_reason == "abort"


def resumes(
    previous: GenerateCall,
    call: GenerateCall,
    previous_ids: Callable[[], list[int] | None] | None = None,
) -> bool:
    """Is `call` the interrupted `previous` generate, re-sent with what it had generated so far
    (AReaL after an abort)? `previous_ids` gives its full prompt ids, when the record keeps
    only their tail (asked only after an abort)."""
    first = previous.outputs[0] if previous.outputs else None
    if first is None or first.finish_reason != "abort":
        return False
    before, now = previous.prompt, call.prompt
    before_ids = ids_list(before.token_ids) if previous_ids is None else previous_ids()
    now_ids = ids_list(now.token_ids)
    if before_ids is not None and now_ids is not None:
        return now_ids == [*before_ids, *(first.token_ids or [])]
    if before.text is not None and now.text is not None and not isinstance(first.text, list):
        return now.text == before.text + output_text(first)
    return False  # nothing to compare (a legacy list of texts is not the output alone)


def version_span(calls: list[GenerateCall]) -> tuple[str | None, str | None]:
    """The oldest and newest policy version that generated any part of `calls` (every attempt
    of a resumed call counted): by value when all are integers (verl's `global_steps`), else
    the first and last seen. (None, None) when no call has a version."""
    seen: list[str] = []
    for call in calls:
        attempts = call.segments or [{"weight_version": call.weight_version}]
        seen += [v for v in (a.get("weight_version") for a in attempts) if isinstance(v, str)]
    if not seen:
        return None, None
    try:
        numbers = [int(v) for v in seen]
    except ValueError:
        return seen[0], seen[-1]
    return seen[numbers.index(min(numbers))], seen[numbers.index(max(numbers))]


def merge_resumed(target: GenerateCall, call: GenerateCall) -> None:
    """One logical generate from an interrupted call and its resumption (AReaL, verl's
    partial rollout): outputs concatenated, each HTTP call kept in `segments` with the
    version that produced it and the tokens it carried over from the attempts before it."""
    if target.segments is None:
        target.segments = [_segment(target, 0)]
    first = target.outputs[0] if target.outputs else None
    target.segments.append(_segment(call, len(first.token_ids or ()) if first else 0))
    for output, more in zip(target.outputs, call.outputs, strict=False):
        output.token_ids = [*(output.token_ids or []), *(more.token_ids or [])] or None
        output.text = (output_text(output) + output_text(more)) or None
        if output.logprobs is not None or more.logprobs is not None:
            output.logprobs = [*(output.logprobs or []), *(more.logprobs or [])]
        output.finish_reason, output.stop_reason = more.finish_reason, more.stop_reason
    target.end, target.http_status, target.error = call.end, call.http_status, call.error
    if target.usage is not None and call.usage is not None:
        done = _tokens(target.usage.get("completion_tokens"), 0)
        target.usage["completion_tokens"] = done + _tokens(call.usage.get("completion_tokens"), 0)
    target.weight_version = call.weight_version or target.weight_version


def _tokens(reported: Any, counted: int) -> int:
    """A token count the server reported, else the one counted from ids: a count that is not
    a number (a server's bug, or no count at all) must not keep a trajectory from closing."""
    try:
        return int(reported or counted)
    except (TypeError, ValueError, OverflowError):
        return counted


def _segment(call: GenerateCall, carried: int) -> dict[str, Any]:
    """One attempt: `carried` tokens generated by the attempts before it (sent back as part of
    its prompt), `tokens` generated by this one, and why it stopped."""
    first = call.outputs[0] if call.outputs else None
    return {
        "start": call.start, "end": call.end, "request_id": call.request_id,
        "http_status": call.http_status, "finish_reason": first.finish_reason if first else None,
        "weight_version": call.weight_version, "carried_tokens": carried,
        "tokens": len(first.token_ids or ()) if first else 0,
    }  # fmt: skip


def fill_missing(target: RolloutKey, source: RolloutKey) -> None:
    for name in ("step", "sample_index", "rollout_n", "validate", "trajectory_id", "sample_id"):
        if getattr(target, name) is None and getattr(source, name) is not None:
            setattr(target, name, getattr(source, name))
            if name in source.sources:
                target.sources[name] = source.sources[name]
