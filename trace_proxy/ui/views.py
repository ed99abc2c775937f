"""What the viewer's pages show, worked out from stored records: turns, timelines, groups,
divergence between siblings. Plain data; the templates escape every string of it.

Prompts are shared by prefix in the record (docs/record-schema.md); a turn shows what its
prompt added (the stored suffix, decoded by token2text when the proxy had a tokenizer) and
what came back. Full prompts are rebuilt with `expand_prompts` where they are needed.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from markupsafe import Markup, escape

from trace_proxy.trajectories.prompts import common_prefix, expand_prompts
from trace_proxy.ui.index import Entry, as_dict, as_list

# Chat-template markup that tokenizers keep as special tokens: `<|im_start|>`, `<|eot_id|>`,
# gpt-oss `<|channel|>`, Qwen/Hermes tool and thinking tags, Llama 2 / Mistral `<s>`, `[INST]`.
SPECIAL = re.compile(r"<\|[^<>|\s]{1,64}\|>|</?(?:tool_call|tool_response|think)>|</?s>|\[/?INST\]")


def marked(text: Any) -> Markup:
    """`text` escaped, with special tokens wrapped so the page shows them apart."""
    value = "" if text is None else str(text)
    pieces: list[str] = []
    position = 0
    for match in SPECIAL.finditer(value):
        pieces.append(str(escape(value[position : match.start()])))
        pieces.append(f'<span class="special">{escape(match.group())}</span>')
        position = match.end()
    pieces.append(str(escape(value[position:])))
    return Markup("".join(pieces))


MAX_TOKENS_SHOWN = 4096  # per output, in the logprobs strip; the raw record has them all


@dataclass
class Output:
    text: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    reasoning: str | None
    # (token id, logprob, its text when the viewer has a tokenizer) when logprobs were recorded
    tokens: list[tuple[int, float | None, str | None]]
    token_count: int


@dataclass
class Drift:
    """One drift check that failed on a call: where the ids first differ, and the two tokens."""

    kind: str  # prefix: the next prompt leaves this call's ids; roundtrip: decode + encode
    at: int | None  # position in the next prompt (prefix) or in the output's ids (roundtrip)
    part: str | None  # prefix: "response" or "prompt", where in this call's ids it lies
    output: int | None  # roundtrip: which output
    expected: int | None  # the token generated (or sent before)
    got: int | None  # the token in its place
    expected_text: str | None
    got_text: str | None

    @property
    def summary(self) -> str:
        if self.kind == "prefix":
            return f"the next prompt leaves this call's {self.part or 'ids'} at its token {self.at}"
        return f"output {self.output}: decoding and encoding changes token {self.at}"


def drifts_of(call: dict[str, Any]) -> list[Drift]:
    """A stored call's failed drift checks, in a fixed order (prefix, then roundtrip)."""
    found = as_dict(call.get("drift"))
    marks = []
    for kind in ("prefix", "roundtrip"):
        item = found.get(kind)
        if isinstance(item, dict):
            marks.append(
                Drift(
                    kind=kind,
                    at=_int_or_none(item.get("at")),
                    part=_str(item.get("in")),
                    output=_int_or_none(item.get("output")),
                    expected=_int_or_none(item.get("expected")),
                    got=_int_or_none(item.get("got")),
                    expected_text=_str(item.get("expected_text")),
                    got_text=_str(item.get("got_text")),
                )
            )
    return marks


@dataclass
class DriftingCall:
    """A drifting call for the run's drift list: its trajectory, turn and marks."""

    entry: Entry
    turn: int  # position in the trajectory (turn - 1 on the page)
    call: int | None  # the call's index
    marks: list[Drift]


def drifting_calls(entry: Entry, record: dict[str, Any]) -> list[DriftingCall]:
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    found = []
    for position, call in enumerate(calls):
        marks = drifts_of(call)
        if marks:
            found.append(DriftingCall(entry, position, _int_or_none(call.get("index")), marks))
    return found


@dataclass
class Turn:
    index: int
    call: dict[str, Any]
    added_text: str | None  # the decoded prompt suffix
    added_messages: list[dict[str, Any]]  # chat messages the prompt added
    prompt_tokens: int  # the full prompt's length
    outputs: list[Output]
    tools: list[dict[str, Any]]  # spans this call asked for
    error: dict[str, Any] | None
    unparsed: str | None
    drift: list[Drift] = field(default_factory=list)
    messages: list[Any] = field(default_factory=list)  # the whole chat prompt, sharing undone

    @property
    def spanned_ids(self) -> set[str]:
        """Ids of the tool calls shown as tool spans (with their results): a page shows such a
        call once, as its span, not again among the output's tool calls."""
        return {str(t["call_id"]) for t in self.tools if t.get("call_id") is not None}

    @property
    def response(self) -> str:
        """The first output as one text: its decoded response, else its text and tool calls."""
        if not self.outputs:
            return ""
        first = self.outputs[0]
        if first.text is not None:
            return first.text
        return " ".join(
            f"{(c.get('function') or {}).get('name')}({(c.get('function') or {}).get('arguments')})"
            for c in first.tool_calls
        )


@dataclass
class Span:
    kind: str  # generate | segment (an attempt of a resumed generate) | tool
    label: str
    start: float  # seconds after the trajectory's start
    end: float | None
    first_byte: float | None = None
    error: bool = False
    version: str | None = None  # the policy version that generated it


@dataclass
class Sync:
    """A weight sync between two attempts or calls: the policy version changed there."""

    at: float  # seconds after the trajectory's start: between the two
    before: str
    after: str


@dataclass
class Trajectory:
    record: dict[str, Any]
    turns: list[Turn]
    early_tools: list[dict[str, Any]]  # tool spans no call asked for (tool servers first)
    spans: list[Span]
    duration: float
    syncs: list[Sync] = field(default_factory=list)


Piece = Callable[[int], str]  # one token id's text


def trajectory_view(record: dict[str, Any], piece: Piece | None = None) -> Trajectory:
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    tools = [t for t in record.get("tools") or [] if isinstance(t, dict)]
    prompts = expand_prompts({"calls": calls})
    by_caller: dict[Any, list[dict[str, Any]]] = {}
    for tool in tools:
        by_caller.setdefault(tool.get("requested_by"), []).append(tool)
    turns = [
        _turn(position, call, prompt, by_caller.get(call.get("index"), []), piece)
        for position, (call, prompt) in enumerate(zip(calls, prompts, strict=True))
    ]
    known = {c.get("index") for c in calls}
    early = [t for caller, group in by_caller.items() if caller not in known for t in group]
    t0 = _num(record.get("start"))
    spans: list[Span] = []
    for c in calls:
        version = _str(c.get("weight_version"))
        spans.append(Span(
            "generate", f"call {c.get('index')}" + (f" · v{version}" if version else ""),
            _num(c.get("start")) - t0, _opt(c.get("end"), t0), _opt(c.get("first_byte"), t0),
            bool(c.get("error")), version,
        ))  # fmt: skip
        for number, segment in enumerate(_segments(c), 1):
            version = _str(segment.get("weight_version"))
            spans.append(Span(
                "segment", f"attempt {number}" + (f" · v{version}" if version else ""),
                _num(segment.get("start")) - t0, _opt(segment.get("end"), t0), None,
                _int_or_none(segment.get("http_status")) not in (None, 200), version,
            ))  # fmt: skip
    spans += [
        Span("tool", str(t.get("name") or t.get("route") or "tool"), _num(t.get("start")) - t0,
             _opt(t.get("end"), t0), None, bool(t.get("error")))
        for t in tools
    ]  # fmt: skip
    duration = max(0.0, _num(record.get("end")) - t0)
    return Trajectory(record, turns, early, spans, duration, weight_syncs(spans))


def _segments(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in as_list(call.get("segments")) if isinstance(s, dict)]


def weight_syncs(spans: Sequence[Span]) -> list[Sync]:
    """Where the policy version changes from one generation to the next (the attempts of a
    resumed call in place of the call), in time order: a sync between the two."""
    resumed = {n for n, s in enumerate(spans) if s.kind == "generate" and n + 1 < len(spans)
               and spans[n + 1].kind == "segment"}  # fmt: skip
    runs = sorted(
        (s for n, s in enumerate(spans)
         if s.version is not None and s.kind != "tool" and n not in resumed),
        key=lambda s: s.start,
    )  # fmt: skip
    syncs = []
    for before, after in itertools.pairwise(runs):
        if before.version != after.version and before.version and after.version:
            end = before.end if before.end is not None else after.start
            syncs.append(Sync((min(end, after.start) + after.start) / 2, before.version,
                              after.version))  # fmt: skip
    return syncs


def _turn(
    position: int,
    call: dict[str, Any],
    full_prompt: dict[str, Any],
    tools: list[dict[str, Any]],
    piece: Piece | None,
) -> Turn:
    prompt = as_dict(call.get("prompt"))
    added_text = call.get("prompt_text")
    if added_text is None and isinstance(prompt.get("text"), str):
        added_text = prompt["text"]
    messages = as_list(prompt.get("messages"))
    ids = full_prompt.get("token_ids")
    outputs = []
    for output in call.get("outputs") or []:
        if not isinstance(output, dict):
            continue
        token_ids = as_list(output.get("token_ids"))
        logprobs = as_list(output.get("logprobs"))
        tokens: list[tuple[int, float | None, str | None]] = []
        if logprobs:
            tokens = [
                (i, lp if isinstance(lp, (int, float)) else None, _piece(piece, i))
                for i, lp in zip(token_ids[:MAX_TOKENS_SHOWN], logprobs, strict=False)
            ]
        text = output.get("response_text")
        if text is None:
            text = output.get("text")
        outputs.append(
            Output(
                text=None if text is None else str(text),
                tool_calls=[t for t in output.get("tool_calls") or [] if isinstance(t, dict)],
                finish_reason=_str(output.get("finish_reason")),
                reasoning=_str(output.get("reasoning")),
                tokens=tokens,
                token_count=len(token_ids),
            )
        )
    return Turn(
        index=position,
        call=call,
        added_text=None if added_text is None else str(added_text),
        added_messages=[m for m in messages if isinstance(m, dict)],
        prompt_tokens=len(ids) if isinstance(ids, list) else 0,
        outputs=outputs,
        tools=tools,
        error=call.get("error") if isinstance(call.get("error"), dict) else None,
        unparsed=_str(call.get("unparsed")),
        drift=drifts_of(call),
        messages=as_list(full_prompt.get("messages")),
    )


def message_text(message: dict[str, Any]) -> str:
    """A chat message's content as text (parts joined; tool calls named)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    calls = message.get("tool_calls") or []
    return " ".join(
        f"{(c.get('function') or {}).get('name')}({(c.get('function') or {}).get('arguments')})"
        for c in calls if isinstance(c, dict)
    )  # fmt: skip


# --- comparing siblings ----------------------------------------------------------------------


@dataclass
class Divergence:
    """Where sibling rollouts first differ: a turn, in its added prompt or its response, and
    the character (and token, when ids were recorded) where it starts."""

    turn: int
    where: str  # prompt | response | length (one rollout has no such turn)
    chars: int
    tokens: int | None
    # What was compared: `text` (the turns' shown text, where `chars` points), or, when only
    # some sides were decoded by token2text (a replay without a tokenizer, say), what each
    # was sent and answered: `messages` (the added chat messages), `api` (the server's text
    # and tool calls). Then `chars` is not a place in the shown text.
    basis: str = "text"


def turn_ids(turn: Turn, part: str) -> list[Any] | None:
    if part == "prompt":
        ids = (turn.call.get("prompt") or {}).get("token_ids")
    else:
        first = (turn.call.get("outputs") or [{}])[0]
        ids = first.get("token_ids") if isinstance(first, dict) else None
    return ids if isinstance(ids, list) else None


def first_divergence(rollouts: Sequence[Trajectory]) -> Divergence | None:
    """The first turn where `rollouts` differ, and where in it; None when they do not."""
    if len(rollouts) < 2:
        return None
    for position in range(max(len(r.turns) for r in rollouts)):
        if any(position >= len(r.turns) for r in rollouts):
            return Divergence(position, "length", 0, None)
        turns = [r.turns[position] for r in rollouts]
        for part in ("prompt", "response"):
            texts, basis = _compared(turns, part)
            ids = [turn_ids(t, part) for t in turns]
            same_ids = all(i is not None for i in ids) and all(i == ids[0] for i in ids)
            if all(t == texts[0] for t in texts) and (same_ids or None in ids):
                continue
            chars = min(common_prefix(texts[0], t) for t in texts[1:])
            tokens = None
            if all(i is not None for i in ids):
                tokens = min(common_prefix(ids[0] or [], i or []) for i in ids[1:])
            return Divergence(position, part, chars, tokens, basis)
    return None


def _compared(turns: Sequence[Turn], part: str) -> tuple[list[str], str]:
    """What of each turn's `part` is compared, and on which basis (see `Divergence.basis`):
    decoded text against decoded text only."""
    if part == "prompt":
        if all(t.added_text is not None for t in turns):
            return [t.added_text or "" for t in turns], "text"
        if all(t.added_text is None for t in turns):
            return [repr(t.added_messages) for t in turns], "text"
        # Each side's whole chat prompt: how much of it is stored as shared with an earlier
        # call depends on what that call answered, so the stored suffixes may differ.
        return [repr(t.messages) for t in turns], "messages"
    decoded = [_first_output(t).get("response_text") is not None for t in turns]
    if all(decoded) or not any(decoded):
        return [t.response for t in turns], "text"
    return [_api_response(t) for t in turns], "api"


def _first_output(turn: Turn) -> dict[str, Any]:
    outputs = turn.call.get("outputs")
    first = outputs[0] if isinstance(outputs, list) and outputs else None
    return first if isinstance(first, dict) else {}


def _api_response(turn: Turn) -> str:
    """A turn's first output as the server sent it: its text, else its tool calls."""
    first = _first_output(turn)
    if first.get("text"):
        return str(first["text"])
    return " ".join(
        f"{(c.get('function') or {}).get('name')}({(c.get('function') or {}).get('arguments')})"
        for c in as_list(first.get("tool_calls")) if isinstance(c, dict)
    )  # fmt: skip


def split_at(text: str | None, chars: int) -> tuple[str, str]:
    value = text or ""
    return value[:chars], value[chars:]


# --- groups of a step ------------------------------------------------------------------------


PROMPT_START = 160  # characters of a group's prompt on the step page; the rest one click away


@dataclass
class Rollouts:
    """Rollouts and their rewards: a GRPO group, or one prompt's rollouts at one step."""

    rollouts: list[Entry]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.rollouts if e.reward is not None and math.isfinite(e.reward)]

    @property
    def reward_mean(self) -> float | None:
        rewards = self.rewards
        return sum(rewards) / len(rewards) if rewards else None

    @property
    def reward_spread(self) -> float:
        rewards = self.rewards
        return max(rewards) - min(rewards) if rewards else 0.0

    @property
    def best(self) -> Entry | None:
        """The first rollout with the highest reward, when the rewards differ."""
        rewarded = self._rewarded()
        return max(rewarded, key=lambda e: e.reward or 0.0) if rewarded else None

    @property
    def worst(self) -> Entry | None:
        """The first rollout with the lowest reward, when the rewards differ."""
        rewarded = self._rewarded()
        return min(rewarded, key=lambda e: e.reward or 0.0) if rewarded else None

    def _rewarded(self) -> list[Entry]:
        rewarded = [e for e in self.rollouts if e.reward is not None and math.isfinite(e.reward)]
        return rewarded if len({e.reward for e in rewarded}) > 1 else []


@dataclass
class Group(Rollouts):
    name: str = ""
    shown: list[Entry] = field(default_factory=list)  # after filters, in the chosen order
    prompt: str | None = None  # what the sample asks (`sample_prompt`), when read
    prompt_steps: int = 0  # steps where its prompt was kept (see history.py)

    @property
    def prompt_start(self) -> str:
        """The prompt's first characters on one line (whitespace runs made one space)."""
        return " ".join((self.prompt or "")[: PROMPT_START * 2].split())[:PROMPT_START]

    @property
    def prompt_cut(self) -> bool:
        """Does `prompt_start` leave some of the prompt's text out?"""
        return len(self.prompt_start) < len(" ".join((self.prompt or "").split()))


def sample_prompt(record: dict[str, Any]) -> str | None:
    """What a rollout's sample asks: its first call's first user message, else the text of its
    first prompt (a text prompt, or token ids decoded by token2text). None when unknown."""
    calls = record.get("calls")
    first = as_dict(calls[0]) if isinstance(calls, list) and calls else {}
    prompt = as_dict(first.get("prompt"))
    messages = prompt.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user":
                text = _message_text(message.get("content"))
                if text:
                    return text
    for text in (prompt.get("text"), first.get("prompt_text")):
        if isinstance(text, str) and text.strip():
            return text
    return None


def _message_text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list of parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(t for t in parts if isinstance(t, str)) or None
    return None


def rollout_order(entry: Entry) -> tuple[int, int, float]:
    return (-1 if entry.rollout_n is None else entry.rollout_n, entry.part, entry.start)


def group_order(group: Group) -> tuple[int, Any, str]:
    first = group.rollouts[0]
    return (0, first.sample_index, "") if first.sample_index is not None else (1, 0, group.name)


def groups_of(entries: Sequence[Entry]) -> list[Group]:
    grouped: dict[str, list[Entry]] = {}
    for entry in entries:
        grouped.setdefault(entry.group, []).append(entry)
    groups = [Group(sorted(members, key=rollout_order), name) for name, members in grouped.items()]
    return sorted(groups, key=group_order)


# --- helpers ---------------------------------------------------------------------------------


def _piece(piece: Piece | None, token: Any) -> str | None:
    if piece is None or not isinstance(token, int) or isinstance(token, bool):
        return None
    try:
        return piece(token)
    except Exception:  # an id the tokenizer does not know: shown as the id
        return None


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _opt(value: Any, t0: float) -> float | None:
    return _num(value) - t0 if isinstance(value, (int, float)) else None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
