"""The RL form: one row per turn (a generate call's output), the tokens a trainer replays.

`prompt_ids` is the call's whole prompt as the server got it (prefix sharing undone with
`expand_prompts`) and `response_ids` the tokens the model generated for it, so `loss_mask` is
1 for each of them. Tool results never sit in a response here: they are the tokens the next
turn's prompt adds after this turn's prompt and response. verl's agent loop and slime keep one
sequence per trajectory instead (prompt, then every turn's response and tool tokens), with a
mask of 0 over the tool tokens; that sequence is the first turn's `prompt_ids` followed, turn by
turn, by `response_ids` (mask 1) and what the next `prompt_ids` adds after them (mask 0).

`logprobs` are the sampled tokens' log-probabilities when the call asked for them. A call
recorded without token ids (chat without `return_token_ids`, text completions) gets them from
`--tokenizer` when one is given (`ids_from` says `tokenizer`): the prompt rendered by its chat
template, the response as the template renders the answer after it (ending at the model's
end-of-turn token). Without one they stay null, and the summary counts them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from trace_proxy.dataset.columns import key_columns, text_or_none
from trace_proxy.dataset.sft import chat_message, tool_call
from trace_proxy.trajectories import versions
from trace_proxy.trajectories.prompts import expand_prompts

NO_IDS = "turns without token ids (null; give --tokenizer to fill them)"
FILLED = "turns with token ids from --tokenizer"
NO_OUTPUT = "calls without an output (failed), left out"


class IdsFromTokenizer:
    """Token ids a record lacks, from the tokenizer the model used."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, prompt: dict[str, Any]) -> list[int] | None:
        messages = prompt.get("messages")
        if isinstance(messages, list):
            text = self._render(messages, prompt.get("tools"), generation=True)
            return None if text is None else self._encode(text, special=False)
        if isinstance(prompt.get("text"), str):  # a text prompt, as vLLM tokenizes it
            return self._encode(prompt["text"], special=True)
        return None

    def response_ids(self, prompt: dict[str, Any], output: dict[str, Any]) -> list[int] | None:
        messages = prompt.get("messages")
        if not isinstance(messages, list):
            text = output.get("text")
            return self._encode(text, special=False) if isinstance(text, str) else None
        answer = {
            "role": "assistant",
            "content": output.get("text") or "",
            "tool_calls": [tool_call(c) for c in output.get("tool_calls") or []] or None,
        }
        head = self._render(messages, prompt.get("tools"), generation=True)
        whole = self._render([*messages, answer], prompt.get("tools"), generation=False)
        if head is None or whole is None or not whole.startswith(head):
            return None
        reply = whole[len(head) :]
        end = getattr(self.tokenizer, "eos_token", None)
        if isinstance(end, str) and end and end in reply:
            reply = reply[: reply.rindex(end) + len(end)]  # the template's newline after it: not
        return self._encode(reply, special=False)

    def _render(self, messages: list[Any], tools: Any, generation: bool) -> str | None:
        shaped = [chat_message(m) for m in messages if isinstance(m, dict)]
        shaped = [{k: v for k, v in m.items() if v is not None} for m in shaped]
        try:
            text = self.tokenizer.apply_chat_template(
                shaped, tools=tools or None, add_generation_prompt=generation, tokenize=False
            )
        except Exception:  # a template that cannot render these messages: ids stay unknown
            return None
        return text if isinstance(text, str) else None

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))


def rl_rows(
    record: dict[str, Any], fill: IdsFromTokenizer | None, notes: Counter[str]
) -> list[dict[str, Any]]:
    """The rows of one trajectory (late rewards already merged into `record`), turn by turn."""
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
    prompts = expand_prompts({"calls": calls})
    shared = key_columns(record)
    latest = text_or_none(record.get("weight_version_latest"))
    trajectory_versions = {
        "weight_version_min": text_or_none(record.get("weight_version_min")),
        "weight_version_max": text_or_none(record.get("weight_version_max")),
        "weight_version_latest": latest,
        "partial_rollout": bool(record.get("partial_rollout")),
    }
    rows = []
    for position, (call, prompt) in enumerate(zip(calls, prompts, strict=True)):
        outputs = [o for o in call.get("outputs") or [] if isinstance(o, dict)]
        version = text_or_none(call.get("weight_version"))
        if not outputs:
            notes[NO_OUTPUT] += 1
        for number, output in enumerate(outputs):
            prompt_ids, response_ids = _ids(prompt.get("token_ids")), _ids(output.get("token_ids"))
            source: str | None = "record"
            if (prompt_ids is None or response_ids is None) and fill is not None:
                if prompt_ids is None:
                    prompt_ids = fill.prompt_ids(prompt)
                if response_ids is None:
                    response_ids = fill.response_ids(prompt, output)
                source = "tokenizer"
            if prompt_ids is None or response_ids is None:
                source = None
                notes[NO_IDS] += 1
            elif source == "tokenizer":
                notes[FILLED] += 1
            rows.append(
                {
                    **shared,
                    "turn": _index(call.get("index"), position),
                    "output": _index(output.get("index"), number),
                    "turns": len(calls),
                    "prompt_ids": prompt_ids,
                    "response_ids": response_ids,
                    "loss_mask": None if response_ids is None else [1] * len(response_ids),
                    "logprobs": _logprobs(output.get("logprobs"), response_ids),
                    "finish_reason": text_or_none(output.get("finish_reason")),
                    "weight_version": version,
                    "weight_versions": _attempt_versions(call),
                    "version_lag": versions.distance(version, latest),
                    **trajectory_versions,
                    "model": text_or_none(call.get("model")),
                    "ids_from": source,
                }
            )
    return rows


def _attempt_versions(call: dict[str, Any]) -> list[str | None] | None:
    """The version of each attempt of a call, in order: one for a call sent once; null when
    no attempt has one."""
    segments = [s for s in call.get("segments") or [] if isinstance(s, dict)]
    found = [text_or_none(s.get("weight_version")) for s in segments] or [
        text_or_none(call.get("weight_version"))
    ]
    return found if any(v is not None for v in found) else None


def _ids(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    return None


def _logprobs(value: Any, response: list[int] | None) -> list[float | None] | None:
    """The sampled tokens' logprobs, when there is one for each response token."""
    if not isinstance(value, list) or response is None or len(value) != len(response):
        return None
    return [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
            for v in value]  # fmt: skip


def _index(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
