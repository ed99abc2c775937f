"""A token-in trajectory's conversation as OpenAI chat messages, read from its decoded text.

Token-in trajectories (completions with ids, vLLM's and SGLang's generate) say their
conversation in decoded text, when the record has it (token2text, or an export's tokenizer):
the first prompt's turns, then per call the answer as the tool parser reads it (its calls
named after the trajectory's tool spans) and the turns the next prompt adds after it (tool
results, a user's next question...). Turns are read from the chat template's markers where
the tool parser's family knows them (ChatML, harmony); other text is one `user` message
marked `unparsed`, holding it as written. So where the template is known, the messages
rendered with it give back the last prompt and its answer.

One reading for every reader of a stored trajectory: the SFT export's rows and the trace
backends' conversations (trackio) are the same messages.
"""

from __future__ import annotations

import json
from typing import Any

from trace_proxy.text.toolparsers import ParsedResponse, ToolCallParser
from trace_proxy.trajectories.prompts import expand_prompts, prompt_texts

Message = dict[str, Any]


def token_messages(record: dict[str, Any], parser: ToolCallParser) -> list[Message] | None:
    """The conversation of a token-in trajectory in its JSON form (as the store holds it);
    None when the record holds no text for it (recorded without a tokenizer)."""
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    return token_conversation(record, calls, expand_prompts({"calls": calls}), parser)


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
             "function": {"name": _text_or_none(n["name"]),
                          "arguments": arguments_text(n["arguments"])}}
            for n in named
        ]  # fmt: skip
        self.messages.append(
            message(
                "assistant", content=parsed.content, reasoning=parsed.reasoning,
                tool_calls=calls_made,
            )
        )  # fmt: skip
        self._asked = list(calls_made)


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


def first_output(call: dict[str, Any]) -> dict[str, Any] | None:
    outputs = call.get("outputs") or []
    return outputs[0] if outputs and isinstance(outputs[0], dict) else None


def arguments_text(value: Any) -> str | None:
    """Tool-call arguments as the JSON string OpenAI messages carry."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
