"""Prefix sharing of prompts, so a trajectory grows with its tokens, not with turns x tokens.

Turn N of a multi-turn rollout usually re-sends turn N-1's prompt and response before the new
tool result. `share_prefixes` stores such a prompt as (earlier call, how many items of its
context, new suffix); `expand_prompts` undoes it for readers of the stored JSON.

A call's context is what a later prompt can extend: its prompt followed by its first output for
token ids and text; for chat, its messages followed by the assistant message the client sends
back for one of its outputs, when that message is the output's content, tool calls and
reasoning as the server gave them (`reply_reference`): a turn then stores only what it added.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from trace_proxy.trajectories.record import GenerateCall, Output, Prompt, ids_list

# Fewer shared items than this are not worth a reference (a message is worth it on its own).
MIN_SHARED = {"token_ids": 4, "text": 16, "messages": 1}

# The members of an assistant message a client echoes from a chat output, and the output's
# field each one is rebuilt from (vLLM and SGLang name the reasoning either way).
REPLY_FIELDS = {
    "content": "text",
    "tool_calls": "tool_calls",
    "reasoning_content": "reasoning",
    "reasoning": "reasoning",
}
# Members an echo must carry when the output has them: without them it is another message.
_REQUIRED = ("content", "tool_calls")


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


def reply_reference(message: Any, outputs: Sequence[Output]) -> dict[str, Any] | None:
    """How `message`, sent after a call's messages, is rebuilt from one of that call's
    `outputs`, or None when it is not such an echo.

    `{"output": position in outputs, "message": the message with each member taken from the
    output set to null (or to its shape, `_shape`, when the client wrote the members of its
    objects in another order), "from_output": those members}`. A member is taken from the
    output when it is the same JSON value as the output's field (types exact, objects by their
    members); a member the output has no value for is kept only when empty (null, "", []);
    content and tool calls the output has must be there. Anything else (an edited reply, one rebuilt
    another way) is not an echo and is stored as sent."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    for position, output in enumerate(outputs):
        taken = _taken_from(message, output)
        if taken:
            skeleton = {
                key: _shape(value, getattr(output, REPLY_FIELDS[key])) if key in taken else value
                for key, value in message.items()
            }
            return {"output": position, "message": skeleton, "from_output": taken}
    return None


def _taken_from(message: dict[str, Any], output: Output) -> list[str] | None:
    for key in _REQUIRED:
        if key not in message and getattr(output, REPLY_FIELDS[key]) is not None:
            return None
    taken = []
    for key, value in message.items():
        field = REPLY_FIELDS.get(key)
        if field is None:
            continue
        produced = getattr(output, field)
        if produced is None:
            if not (value is None or value == "" or value == []):
                return None
        elif same_json(value, produced):
            taken.append(key)
        else:
            return None
    return taken or None


def same_json(a: Any, b: Any) -> bool:
    """The same JSON value: types exact (1, 1.0 and true differ), objects by their members."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _shape(value: Any, produced: Any) -> Any:
    """None when `value` is written as `produced` is (members in the same order), else its
    shape: every leaf null, objects' members in the order the client wrote them."""
    return None if _same_order(value, produced) else _leaves_nulled(value)


def _same_order(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_order(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_same_order(x, y) for x, y in zip(a, b, strict=True))
    return True


def _leaves_nulled(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _leaves_nulled(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_leaves_nulled(item) for item in value]
    return None


def _in_order_of(value: Any, shape: Any) -> Any:
    """`value` with its objects' members in the order `shape` gives (a reader's side of
    `_shape`; members the shape does not name follow, as they were)."""
    if isinstance(value, dict) and isinstance(shape, dict):
        ordered = {k: _in_order_of(value[k], shape[k]) for k in shape if k in value}
        ordered.update((k, v) for k, v in value.items() if k not in ordered)
        return ordered
    if isinstance(value, list) and isinstance(shape, list):
        return [_in_order_of(item, part) for item, part in zip(value, shape, strict=False)] + (
            value[len(shape) :]
        )
    return value


def reply_message(reference: Any, outputs: Any) -> dict[str, Any] | None:
    """The assistant message a `prefix_reply` reference stands for (a stored record's JSON
    form); None when the reference does not name an output of the call."""
    if not isinstance(reference, dict) or not isinstance(outputs, list):
        return None
    position, skeleton = reference.get("output"), reference.get("message")
    if type(position) is not int or not 0 <= position < len(outputs):
        return None
    output = outputs[position]
    if not isinstance(skeleton, dict) or not isinstance(output, dict):
        return None
    message = dict(skeleton)
    for key in reference.get("from_output") or []:
        field = REPLY_FIELDS.get(key)
        if field is not None and key in message:
            message[key] = _in_order_of(copy.deepcopy(output.get(field)), message[key])
    return message


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
            reply: dict[str, Any] | None = None
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
                if kind == "messages" and shared == len(prev_full.messages or ()) < len(value):
                    reply = reply_reference(value[shared], prev_call.outputs)
                    shared += reply is not None
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
                    prefix_reply=reply if "messages" in lengths else None,
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
                    reply = reply_message(prompt.get("prefix_reply"), calls[ref].get("outputs"))
                    if reply is not None:
                        context = [*context, reply]
                prompt[kind] = context[:length] + (prompt.get(kind) or context[:0])
            prompt["prefix_call"] = None
            prompt["prefix_len"] = None
            prompt["prefix_reply"] = None
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


def prompt_token_counts(calls: Sequence[dict[str, Any]]) -> list[int]:
    """How many token ids each call's whole prompt has, as `expand_prompts` would build it
    (a stored trajectory's JSON form), without building them."""
    counts: list[int] = []
    for position, call in enumerate(calls):
        stored = call.get("prompt") or {}
        own = len(stored.get("token_ids") or [])
        ref = stored.get("prefix_call")
        lengths = stored.get("prefix_len") or {}
        if isinstance(ref, int) and 0 <= ref < position and "token_ids" in lengths:
            first = _first_output(calls[ref])
            context = counts[ref] + len(first.get("token_ids") or [])
            own += len(range(context)[: lengths["token_ids"]])  # a slice's length, as sliced
        counts.append(own)
    return counts


def prompt_texts(
    calls: Sequence[dict[str, Any]], counts: Sequence[int] | None = None
) -> list[str | None]:
    """Each call's whole prompt decoded (a stored trajectory's JSON form, `counts` its
    `prompt_token_counts`), when its stored piece extends a known whole context.

    `prompt_text` decodes the token ids as stored: for a call sharing a prefix with an earlier
    one, only the new suffix. The whole text is that call's whole prompt text, plus its first
    response when shared, plus the piece; None when the sharing stops at another token, or
    when the ids were never decoded.
    """
    counts = prompt_token_counts(calls) if counts is None else counts
    texts: list[str | None] = []
    for call in calls:
        piece = call.get("prompt_text")
        stored = call.get("prompt") or {}
        ref = stored.get("prefix_call")
        shared = (stored.get("prefix_len") or {}).get("token_ids")
        if piece is None or ref is None or shared is None:
            texts.append(piece)
            continue
        base_text = texts[ref] if 0 <= ref < len(texts) else None
        base_ids = counts[ref] if 0 <= ref < len(counts) else 0
        first = _first_output(calls[ref]) if 0 <= ref < len(calls) else {}
        if base_text is not None and shared == base_ids:
            texts.append(base_text + piece)
        elif (
            base_text is not None
            and first.get("response_text") is not None
            and shared == base_ids + len(first.get("token_ids") or [])
        ):
            texts.append(base_text + first["response_text"] + piece)
        else:
            texts.append(None)
    return texts


def _first_output(call: dict[str, Any]) -> dict[str, Any]:
    first = (call.get("outputs") or [{}])[0]
    return first if isinstance(first, dict) else {}


def transcript_of(trajectory: dict[str, Any]) -> str | None:
    """A stored trajectory's full decoded transcript: stored as such when the trajectory
    branches, else rebuilt from its calls' decoded pieces (it is not stored twice)."""
    stored = trajectory.get("transcript")
    if stored is not None:
        return str(stored)
    return pieces_text(trajectory.get("calls") or [])
