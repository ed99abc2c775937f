"""The SFT form: one row per trajectory, its conversation as OpenAI chat messages.

Chat trajectories say it outright: the last call's whole prompt (prefix sharing undone with
`expand_prompts`), whose `role: tool` messages hold the earlier tool results, then that call's
answer. Token-in trajectories (completions with ids, vLLM's and SGLang's generate) say it in
decoded text, when the store has it (token2text): the first prompt's turns, then per call the
answer as the tool parser reads it (its calls named after the trajectory's tool spans) and the
turns the next prompt adds after it (tool results, a user's next question...). Turns are read
from the chat template's markers where the tool parser's family knows them (ChatML, harmony);
other text is one `user` message marked `unparsed`, holding it as written. So where the
template is known, the messages rendered with it give back the last prompt and its answer. A
trajectory with no text at all gets no messages (null), and is counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeGuard

from trace_proxy.dataset.columns import key_columns, text_or_none
from trace_proxy.trajectories.prompts import expand_prompts, prompt_texts, transcript_of
from trace_proxy.trajectories.toolparsers import ParsedResponse, ToolCallParser

Message = dict[str, Any]


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


def token_conversation(
    record: dict[str, Any],
    calls: list[dict[str, Any]],
    prompts: list[dict[str, Any]],
    parser: ToolCallParser,
) -> list[Message] | None:
    """A token-in trajectory's conversation from its decoded text and tool spans; None when
    the store holds no text for it (recorded without a tokenizer).

    The first prompt's turns, then per call its answer and the turns the next prompt adds
    after it. A prompt that does not repeat all that came before (a template that re-renders
    earlier turns) is read whole instead: what the model saw last is the conversation."""
    if not calls:
        return None
    texts = [
        text if text is not None or call.get("prompt_text") is not None else _text(prompt)
        for call, prompt, text in zip(calls, prompts, prompt_texts(calls), strict=True)
    ]  # token prompts decoded where the pieces tell them; text prompts as sent
    last_answer = first_output(calls[-1])
    if texts[-1] is None and last_answer is not None and calls[-1].get("prompt_text") is not None:
        texts[-1] = _prompt_of_transcript(record.get("transcript"), answer_text(last_answer))
    if texts[0] is None:
        return None
    spans: dict[Any, list[dict[str, Any]]] = {}
    for span in record.get("tools") or []:
        if isinstance(span, dict) and span.get("raw") is None:
            spans.setdefault(span.get("requested_by"), []).append(span)
    conversation = Conversation(parser)
    conversation.add_prompt(texts[0], after_answer=False)
    context: str | None = texts[0]  # the prompt and answers so far, as the model saw them
    for position, call in enumerate(calls):
        full = texts[position] if position else context
        if position and full is None:
            conversation.lose_track()
        elif position and context is not None and full is not None and full.startswith(context):
            conversation.add_prompt(full[len(context) :], after_answer=True)
        elif position and full is not None:  # it re-renders what came before
            conversation = Conversation(parser)
            conversation.add_prompt(full, after_answer=False)
        answer = first_output(call)
        text = None if answer is None else answer_text(answer)
        if answer is not None and text is None:
            return None
        if text is not None:
            conversation.add_answer(text, call.get("index", position), spans)
        context = None if full is None or text is None else full + text
    return conversation.messages


def _text(prompt: dict[str, Any]) -> str | None:
    return prompt["text"] if isinstance(prompt.get("text"), str) else None


def answer_text(answer: dict[str, Any]) -> str | None:
    """An answer as the model wrote it: its decoded ids (special tokens kept), else its text."""
    for name in ("response_text", "text"):
        if isinstance(answer.get(name), str):
            return str(answer[name])
    return None


def _prompt_of_transcript(transcript: Any, answer: str | None) -> str | None:
    """The last prompt's text, from the transcript token2text stores when the calls' pieces do
    not spell it out (the last prompt and its answer, decoded whole)."""
    if not isinstance(transcript, str) or answer is None or not transcript.endswith(answer):
        return None
    return transcript[: len(transcript) - len(answer)]


class Conversation:
    """Messages as a token conversation's pieces of text come: prompt text, read as the chat
    template's turns where `parser` knows the template, else one `user` message marked
    `unparsed`; answers as the parser reads them; tool results paired, in order, with the
    calls of the assistant turn before them."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.messages: list[Message] = []
        self._asked: list[dict[str, Any]] = []  # calls of the last assistant turn, unanswered
        self._answer: tuple[int, str] | None = None  # the last message, when it is an answer

    def add_prompt(self, text: str, *, after_answer: bool) -> None:
        """What a prompt adds (its whole text, for the first): nothing after an answer means the
        next answer goes on with it (a response cut short, continued)."""
        if after_answer and not text:
            return
        self._answer = None
        turns = self.parser.turns(text, after_answer=after_answer)
        if turns is None:
            self.messages.append(message("user", content=text, unparsed=True))
            self._asked = []
            return
        for turn in turns:
            if turn.role == "tool":
                asked = self._asked.pop(0) if self._asked else {}
                function = asked.get("function") or {}
                self.messages.append(
                    message(
                        "tool", content=turn.content, tool_call_id=asked.get("id"),
                        name=turn.name or function.get("name"),
                    )
                )  # fmt: skip
            elif turn.role == "assistant":
                parsed = self.parser.parse_response(turn.content)
                number = len(self.messages)
                named = [
                    {"id": f"prompt_{number}_{n}", "name": c.name, "arguments": c.arguments}
                    for n, c in enumerate(parsed.calls)
                ]
                self._assistant(parsed, named)
            else:
                self.messages.append(message(turn.role, content=turn.content))

    def lose_track(self) -> None:
        """A prompt whose text is not known: what it added is not told, and the answer that
        follows does not go on with the one before."""
        self._answer = None
        self._asked = []

    def add_answer(self, text: str, position: Any, spans: dict[Any, list[dict[str, Any]]]) -> None:
        """A call's answer; its tool calls named after the spans it asked for, when there are."""
        if self._answer is not None:  # the answer before it, continued
            at, before = self._answer
            del self.messages[at:]
            text = before + text
        parsed = self.parser.parse_response(text)
        asked = spans.get(position, [])
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
        at = len(self.messages)
        self._assistant(parsed, named)
        self._answer = (at, text)

    def _assistant(self, parsed: ParsedResponse, named: list[dict[str, Any]]) -> None:
        calls_made = [
            {"id": n["id"], "type": "function",
             "function": {"name": text_or_none(n["name"]), "arguments": _arguments(n["arguments"])}}
            for n in named
        ]  # fmt: skip
        self.messages.append(
            message(
                "assistant", content=parsed.content, reasoning=parsed.reasoning,
                tool_calls=calls_made,
            )
        )  # fmt: skip
        self._asked = list(calls_made)


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
    unparsed: bool = False,
) -> Message:
    return {
        "role": role,
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": tool_calls or None,
        "tool_call_id": tool_call_id,
        "name": name,
        "unparsed": unparsed,
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
