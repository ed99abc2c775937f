"""The SFT form: one row per trajectory, its conversation as OpenAI chat messages.

Chat trajectories say it outright: the last call's whole prompt (prefix sharing undone with
`expand_prompts`), whose `role: tool` messages hold the earlier tool results, then that call's
answer. Token-in trajectories (completions with ids, vLLM's and SGLang's generate) say it in
decoded text, when the store has it (token2text): the first prompt split into its ChatML turns
(else one user message with the decoded text), then per call the answer as the tool parser
reads it and, for each tool span it asked for, a `role: tool` message with the span's result.
What a later prompt adds besides tool results is in `text`, the whole decoded transcript, not
in `messages`. A trajectory with no text at all gets no messages (null), and is counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeGuard

from trace_proxy.dataset.columns import key_columns, text_or_none
from trace_proxy.trajectories.prompts import expand_prompts, transcript_of
from trace_proxy.trajectories.toolparsers import ToolCallParser

Message = dict[str, Any]

CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n?", re.DOTALL)
CHATML_REPLY = "<|im_start|>assistant\n"


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
    them), so a store recorded without a tokenizer exports as one recorded with it."""
    for call in record.get("calls") or []:
        if not isinstance(call, dict):
            continue
        ids = (call.get("prompt") or {}).get("token_ids")
        if call.get("prompt_text") is None and _is_ids(ids):
            call["prompt_text"] = _decoded(decode, ids)
        for output in call.get("outputs") or []:
            if not isinstance(output, dict) or output.get("response_text") is not None:
                continue
            if _is_ids(output.get("token_ids")):
                output["response_text"] = _decoded(decode, output["token_ids"])


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


def token_conversation(
    record: dict[str, Any],
    calls: list[dict[str, Any]],
    prompts: list[dict[str, Any]],
    parser: ToolCallParser,
) -> list[Message] | None:
    """A token-in trajectory's conversation from its decoded text and tool spans; None when
    the store holds no text for it (recorded without a tokenizer)."""
    if not calls:
        return None
    opening = text_or_none(calls[0].get("prompt_text")) or text_or_none(prompts[0].get("text"))
    if opening is None:
        return None
    messages = chatml_messages(opening)
    spans: dict[Any, list[dict[str, Any]]] = {}
    for span in record.get("tools") or []:
        if isinstance(span, dict) and span.get("raw") is None:
            spans.setdefault(span.get("requested_by"), []).append(span)
    for position, call in enumerate(calls):
        answer = first_output(call)
        if answer is None:
            continue
        text = text_or_none(answer.get("response_text")) or text_or_none(answer.get("text"))
        if text is None:
            return None
        parsed = parser.parse_response(text)
        asked = spans.get(call.get("index", position), [])
        named = [
            {"id": s.get("call_id") or f"call_{position}_{n}", "name": s.get("name"),
             "arguments": s.get("arguments")}
            for n, s in enumerate(asked)
        ]  # fmt: skip
        if not named:
            named = [
                {"id": f"call_{position}_{n}", "name": c.name, "arguments": c.arguments}
                for n, c in enumerate(parsed.calls)
            ]
        calls_made = [
            {"id": n["id"], "type": "function",
             "function": {"name": text_or_none(n["name"]), "arguments": _arguments(n["arguments"])}}
            for n in named
        ]  # fmt: skip
        messages.append(
            message(
                "assistant", content=parsed.content, reasoning=parsed.reasoning,
                tool_calls=calls_made,
            )
        )  # fmt: skip
        for n, span in zip(named, asked, strict=False):
            if span.get("result") is not None:
                messages.append(
                    message(
                        "tool", content=text_or_none(span["result"]), tool_call_id=n["id"],
                        name=text_or_none(span.get("name")),
                    )
                )  # fmt: skip
    return messages


def chatml_messages(text: str) -> list[Message]:
    """A decoded ChatML prompt's turns as messages (tool results as tool messages); any other
    text, or ChatML with text outside its turns, as one user message holding all of it."""
    position, found = 0, []
    for match in CHATML_TURN.finditer(text):
        if match.start() != position:
            break
        role, body = match.group(1), match.group(2)
        results = re.findall(r"<tool_response>\n?(.*?)\n?</tool_response>", body, re.DOTALL)
        if role == "user" and results:
            found += [message("tool", content=result) for result in results]
        else:
            found.append(message(role, content=body))
        position = match.end()
    rest = text[position:]
    if found and (not rest or rest.startswith(CHATML_REPLY)):
        return found
    return [message("user", content=text)]


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


def message(
    role: str,
    *,
    content: str | None = None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    tool_call_id: str | None = None,
    name: str | None = None,
) -> Message:
    return {
        "role": role,
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": tool_calls or None,
        "tool_call_id": tool_call_id,
        "name": name,
    }


def tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry, its arguments as a JSON string."""
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    return {
        "id": text_or_none(call.get("id")),
        "type": text_or_none(call.get("type")) or "function",
        "function": {
            "name": text_or_none(function.get("name")),
            "arguments": _arguments(function.get("arguments")),
        },
    }


def contenttext_or_none(content: Any) -> str | None:
    """Message content as text: a string, or the text parts of a list of parts, joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def first_output(call: dict[str, Any]) -> dict[str, Any] | None:
    outputs = call.get("outputs") or []
    return outputs[0] if outputs and isinstance(outputs[0], dict) else None


def _arguments(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)
