"""The SFT form: one row per trajectory, its conversation as OpenAI chat messages.

Chat trajectories say it outright: the last call's whole prompt (prefix sharing undone with
`expand_prompts`), whose `role: tool` messages hold the earlier tool results, then that call's
answer. Token-in trajectories say it in decoded text, read as `text.conversation`
reads it for every reader (every turn each prompt adds between two answers, from the chat
template's markers where the tool parser knows them, else one `user` message marked
`unparsed`), so the row's messages are the ones the trace backends show. A trajectory with no
text at all gets no messages (null), and is counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeGuard

from trace_proxy.dataset.columns import key_columns, text_or_none
from trace_proxy.text.conversation import (
    Message,
    arguments_text,
    first_output,
    message,
    token_conversation,
)
from trace_proxy.text.toolparsers import ToolCallParser
from trace_proxy.trajectories.prompts import expand_prompts, transcript_of


def sft_row(record: dict[str, Any], parser: ToolCallParser) -> dict[str, Any]:
    """The row of one trajectory (late rewards already merged into `record`)."""
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    prompts = expand_prompts({"calls": calls})
    last = calls[-1] if calls else {}
    tools = (prompts[-1] if prompts else {}).get("tools")
    if prompts and isinstance(prompts[-1].get("messages"), list):
        messages: list[Message] | None = chat_conversation(prompts[-1]["messages"], last)
    else:
        messages = token_conversation(record, calls, prompts, parser)
    return {
        **key_columns(record),
        "turns": len(calls),
        "model": text_or_none(last.get("model")),
        "messages": messages,
        "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
        "text": transcript_of(record),
    }


def decode_missing(record: dict[str, Any], decode: Callable[[list[int]], str]) -> None:
    """Give `record` the text token2text would have stored, where it has none: each call's
    stored prompt ids and each answer's ids decoded (special tokens kept, as token2text keeps
    them), and the transcript when the pieces do not spell it out, so a store recorded without
    a tokenizer exports as one recorded with it."""
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    for call in calls:
        ids = (call.get("prompt") or {}).get("token_ids")
        if call.get("prompt_text") is None and _is_ids(ids):
            call["prompt_text"] = _decoded(decode, ids)
        for output in call.get("outputs") or []:
            if not isinstance(output, dict) or output.get("response_text") is not None:
                continue
            if _is_ids(output.get("token_ids")):
                output["response_text"] = _decoded(decode, output["token_ids"])
    if calls and record.get("transcript") is None and transcript_of({"calls": calls}) is None:
        last = expand_prompts({"calls": calls})[-1].get("token_ids")
        more = (first_output(calls[-1]) or {}).get("token_ids")
        if _is_ids(last):
            record["transcript"] = _decoded(decode, [*last, *(more if _is_ids(more) else [])])


def _is_ids(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    )


def _decoded(decode: Callable[[list[int]], str], ids: list[int]) -> str | None:
    try:
        return decode(ids)
    except Exception:  # an id the tokenizer does not know: left without text
        return None


def chat_conversation(prompt_messages: list[Any], call: dict[str, Any]) -> list[Message]:
    """A chat call's whole prompt and its first answer, each message in the one shape."""
    messages = [chat_message(m) for m in prompt_messages if isinstance(m, dict)]
    answer = first_output(call)
    if answer is not None:
        messages.append(
            message(
                "assistant",
                content=text_or_none(answer.get("text")),
                reasoning=text_or_none(answer.get("reasoning")),
                tool_calls=[tool_call(c) for c in answer.get("tool_calls") or []],
            )
        )
    return messages


def chat_message(sent: dict[str, Any]) -> Message:
    """A chat message as the client sent it, in the one shape every row's messages share."""
    return message(
        str(sent.get("role")),
        content=contenttext_or_none(sent.get("content")),
        reasoning=text_or_none(sent.get("reasoning_content") or sent.get("reasoning")),
        tool_calls=[tool_call(c) for c in sent.get("tool_calls") or []],
        tool_call_id=text_or_none(sent.get("tool_call_id")),
        name=text_or_none(sent.get("name")),
    )


def tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry, its arguments as a JSON string."""
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    return {
        "id": text_or_none(call.get("id")),
        "type": text_or_none(call.get("type")) or "function",
        "function": {
            "name": text_or_none(function.get("name")),
            "arguments": arguments_text(function.get("arguments")),
        },
    }


def contenttext_or_none(content: Any) -> str | None:
    """Message content as text: a string, or the text parts of a list of parts, joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)
