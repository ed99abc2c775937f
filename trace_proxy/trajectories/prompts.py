"""Prefix sharing of prompts, so a trajectory grows with its tokens, not with turns x tokens.

Turn N of a multi-turn rollout usually re-sends turn N-1's prompt and response before the new
tool result. `share_prefixes` stores such a prompt as (earlier call, how many items of its
context, new suffix); `expand_prompts` undoes it for readers of the stored JSON.

A call's context is what a later prompt can extend: its prompt followed by its first output for
token ids and text, its messages for chat (the client re-sends the assistant turn itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trace_proxy.trajectories.record import GenerateCall, Prompt, ids_list

# Fewer shared items than this are not worth a reference (a message is worth it on its own).
MIN_SHARED = {"token_ids": 4, "text": 16, "messages": 1}


def shared_with_context(full: Prompt, call: GenerateCall, kind: str, value: Any) -> int | None:
    """How many leading items of `value` repeat `call`'s context (None: it has none of `kind`),
    compared piece by piece: the context is not built (a 32k-id copy per call)."""
    first = call.outputs[0] if call.outputs else None
    if kind == "token_ids":
        ids = ids_list(full.token_ids)
        if ids is None:
            return None
        return extension(ids, first.token_ids if first else None, value)
    if kind == "text":
        if full.text is None:
            return None
        return extension(full.text, first.text if first else None, value)
    return None if full.messages is None else common_prefix(full.messages, value)


def extension(base: Sequence[Any], more: Sequence[Any] | None, value: Sequence[Any]) -> int:
    """`common_prefix(base + more, value)`, without making `base + more`."""
    shared = common_prefix(base, value)
    if shared < len(base) or not more:
        return shared
    return shared + common_prefix(more, value[shared : shared + len(more)])


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix, by slice comparisons (C speed) and bisection."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n  # the usual case: the new prompt extends the whole context (one copy, not two)
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def share_prefixes(
    calls: list[GenerateCall], known: Mapping[int, tuple[GenerateCall, int]] | None = None
) -> None:
    """Rewrite each call's prompt as a reference to the previous call plus the new suffix.

    Only the immediately preceding call is a candidate: that is what multi-turn agents extend,
    and it keeps the work linear. `known`, by id() of a call: the call before it and how many
    of its context's token ids the call's prompt shares, compared already (the assembler does
    it as calls arrive); its `token_ids` then hold only what follows them when that is at
    least MIN_SHARED.
    """
    known = known or {}
    previous: tuple[int, Prompt, GenerateCall] | None = None
    for position, call in enumerate(calls):
        full = call.prompt
        if previous is not None:
            ref, prev_full, prev_call = previous
            lengths: dict[str, int] = {}
            suffixes: dict[str, Any] = {}
            for kind, min_shared in MIN_SHARED.items():
                value = getattr(full, kind)
                if value is None:
                    continue
                compared = known.get(id(call)) if kind == "token_ids" else None
                if compared is not None and compared[0] is prev_call:
                    if compared[1] >= min_shared:  # `value` holds what follows already
                        lengths[kind], suffixes[kind] = compared[1], value
                    continue
                shared = shared_with_context(prev_full, prev_call, kind, value)
                if shared is not None and shared >= min_shared:
                    lengths[kind] = shared
                    suffixes[kind] = value[shared:]
            if lengths:
                call.prompt = Prompt(
                    token_ids=suffixes.get("token_ids", full.token_ids),
                    text=suffixes.get("text", full.text),
                    messages=suffixes.get("messages", full.messages),
                    # None: the same tools as the referenced call; [] when this call sent none.
                    tools=None if full.tools == prev_full.tools else (full.tools or []),
                    prefix_call=ref,
                    prefix_len=lengths,
                )
        previous = (position, full, call)


def expand_prompts(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """Full prompts of every call of a stored trajectory (its JSON form), by call position."""
    full: list[dict[str, Any]] = []
    calls = trajectory.get("calls") or []
    for call in calls:
        prompt = dict(call.get("prompt") or {})
        ref = prompt.get("prefix_call")
        if isinstance(ref, int) and 0 <= ref < len(full):
            base = full[ref]
            first = (calls[ref].get("outputs") or [{}])[0]
            if prompt.get("tools") is None:
                prompt["tools"] = base.get("tools")
            for kind, length in (prompt.get("prefix_len") or {}).items():
                if kind == "token_ids":
                    context: Any = (base.get("token_ids") or []) + (first.get("token_ids") or [])
                elif kind == "text":
                    context = (base.get("text") or "") + (first.get("text") or "")
                else:
                    context = base.get("messages") or []
                prompt[kind] = context[:length] + (prompt.get(kind) or context[:0])
            prompt["prefix_call"] = None
            prompt["prefix_len"] = None
        full.append(prompt)
    return full


def full_token_ids(calls: list[GenerateCall]) -> list[list[int] | None]:
    """Full prompt token ids of every call, undoing prefix sharing (the record's own form)."""
    full: list[list[int] | None] = []
    for call in calls:
        prompt = call.prompt
        ref, lengths = prompt.prefix_call, prompt.prefix_len or {}
        ids = ids_list(prompt.token_ids)
        if ids is None:
            full.append(None)
        elif ref is None or "token_ids" not in lengths or full[ref] is None:
            full.append(list(ids))
        else:
            base = calls[ref]
            first = base.outputs[0].token_ids if base.outputs else None
            context = [*(full[ref] or []), *(first or [])]
            full.append(context[: lengths["token_ids"]] + ids)
    return full


def pieces_text(calls: Sequence[dict[str, Any] | GenerateCall]) -> str | None:
    """The transcript as the calls' decoded pieces tell it, when each call extends the whole of
    the one before (prompt + response): first prompt, then response, added text, response...
    None when a call re-renders or drops part of what came before (the trajectory branches)."""
    text = ""
    previous_context: int | None = None
    for position, call in enumerate(calls):
        data = call if isinstance(call, dict) else _call_dict(call)
        prompt = data.get("prompt") or {}
        prompt_text = data.get("prompt_text")
        first = (data.get("outputs") or [{}])[0]
        if prompt_text is None or first.get("response_text") is None:
            return None
        if position > 0:
            lengths = prompt.get("prefix_len") or {}
            if (
                prompt.get("prefix_call") != position - 1
                or lengths.get("token_ids") != previous_context
            ):
                return None
        text += prompt_text + first["response_text"]
        ids = prompt.get("token_ids") or []
        shared = (prompt.get("prefix_len") or {}).get("token_ids", 0) if position else 0
        previous_context = shared + len(ids) + len(first.get("token_ids") or [])
    return text


def _call_dict(call: GenerateCall) -> dict[str, Any]:
    return {
        "prompt": {
            "token_ids": call.prompt.token_ids,
            "prefix_call": call.prompt.prefix_call,
            "prefix_len": call.prompt.prefix_len,
        },
        "prompt_text": call.prompt_text,
        "outputs": [
            {"response_text": o.response_text, "token_ids": o.token_ids} for o in call.outputs
        ],
    }


def transcript_of(trajectory: dict[str, Any]) -> str | None:
    """A stored trajectory's full decoded transcript: stored as such when the trajectory
    branches, else rebuilt from its calls' decoded pieces (it is not stored twice)."""
    stored = trajectory.get("transcript")
    if stored is not None:
        return str(stored)
    return pieces_text(trajectory.get("calls") or [])
