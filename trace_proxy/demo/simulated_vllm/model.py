"""The deterministic "model": real tokens from the real tokenizer, answers from a hash.

The output is chosen from a hash of the prompt token ids, its token ids are the real Qwen
tokenizer's encoding of that text (+ `<|im_end|>` at a stop), chat prompts are rendered with
the tokenizer's chat template so `prompt_token_ids` are real, and with tools it writes Hermes
`<tool_call>` blocks: for the lookups the question needs (policy.py), then the answer their
results give. Tokenizing, rendering and sampling are cached: the simulator sits on the
latency benchmarks' hot path.
"""

from __future__ import annotations

import array
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from .chatml import ascii_text, message_text, parse_chatml, tool_rounds
from .hermes import TOOL_CALL_END, TOOL_CALL_START
from .policy import (
    GUESS_RATE,
    MISTAKE_RATE,
    PARALLEL_RATE,
    answer_from,
    asked_arguments,
    guess,
    mistaken,
    places_in,
    planned_calls,
    user_question,
)
from .wire import DEFAULT_MAX_MODEL_LEN, JSON, hex_digest

_WORDS = (
    "the", "model", "rollout", "policy", "reward", "signal", "step", "token", "agent", "tool",
    "answer", "value", "gradient", "batch", "sample", "trace", "proxy", "server", "request",
    "result", "context", "prompt", "search", "plan", "check", "update", "weights", "data",
    "quickly", "carefully", "then", "again", "with", "from", "into", "over", "and", "while",
)  # fmt: skip
_SENTENCES = (
    "The result looks consistent with the earlier steps.",
    "I checked the details twice and they agree.",
    "This should be enough to continue the task.",
    "Let me know if another lookup would help.",
    "The numbers line up with what was expected.",
    "Nothing unusual showed up in the output.",
    "That settles the question for now.",
    "A short summary follows from these facts.",
)
_QUERY_PARAMS = frozenset(
    {"query", "q", "question", "text", "input", "prompt", "code", "expression"}
)


@dataclass(frozen=True)
class Sample:
    """One generated sequence, fully determined before it is streamed."""

    token_ids: tuple[int, ...]  # includes the stop token when the model stopped on it
    deltas: tuple[str, ...]  # text added by each token; "".join(deltas) == text
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # a stop string or non-EOS stop token id, else None
    logprobs: tuple[float, ...]  # logprob of each sampled token (always rank 1)

    def prefix(self, count: int) -> Sample:
        """The first `count` tokens, as an aborted request would have them."""
        deltas = self.deltas[:count]
        text = "".join(deltas)
        return Sample(self.token_ids[:count], deltas, text, "abort", None, self.logprobs[:count])


@dataclass(frozen=True)
class SampleParams:
    """What shapes a sample besides the prompt (hashable, so samples can be cached)."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    greedy: bool = False  # temperature 0: every sample of a request is the same


class TextModel:
    """The tokenizer plus a deterministic answer generator, with caches for the hot path.

    `split_words`: answers carry each longer word as two tokens where the tokenizer has both
    pieces, as a sampled model sometimes does: ids whose text encodes back to other ids (what
    a client re-tokenizing the reply would change)."""

    def __init__(
        self, tokenizer: Any, max_model_len: int = DEFAULT_MAX_MODEL_LEN, split_words: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.split_words = split_words
        self.eos_id: int = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.special_ids = frozenset(int(i) for i in tokenizer.added_tokens_decoder)
        self._backend = tokenizer.backend_tokenizer
        self._render_cache: dict[bytes, tuple[str, tuple[int, ...]]] = {}
        self.encode = lru_cache(maxsize=8192)(self._encode)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.sample = lru_cache(maxsize=4096)(self._sample)
        self.plan = lru_cache(maxsize=4096)(self._plan)

    # -- tokenization -------------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return tuple(ids)

    def _token_text(self, token_id: int) -> str:
        return str(self._backend.decode([token_id], skip_special_tokens=False))

    def _pieces(self, token_id: int) -> tuple[int, ...]:
        """A word token as two tokens of the vocabulary that spell it (split near its middle),
        else itself."""
        name = self._backend.id_to_token(token_id)
        if token_id in self.special_ids or name is None or len(name) < 6 or not name.isalpha():
            return (token_id,)
        middle = len(name) // 2
        for cut in sorted(range(2, len(name) - 1), key=lambda c: abs(c - middle)):
            first, second = (
                self._backend.token_to_id(name[:cut]),
                self._backend.token_to_id(name[cut:]),
            )
            if first is not None and second is not None:
                return (first, second)
        return (token_id,)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def render_chat(
        self,
        messages: Sequence[JSON],
        tools: Sequence[JSON] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: JSON | None = None,
    ) -> tuple[str, tuple[int, ...]]:
        """Prompt text and token ids, as vLLM renders then tokenizes a chat request."""
        key = orjson.dumps(
            [messages, tools, add_generation_prompt, continue_final_message, template_kwargs],
            option=orjson.OPT_SORT_KEYS,
        )
        cached = self._render_cache.get(key)
        if cached is not None:
            return cached
        normalized = [self._template_message(m) for m in messages]
        text = self.tokenizer.apply_chat_template(
            normalized,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        result = (str(text), self.encode(str(text), False))
        if len(self._render_cache) > 4096:
            self._render_cache.clear()
        self._render_cache[key] = result
        return result

    @staticmethod
    def _template_message(message: JSON) -> JSON:
        out = dict(message)
        if out.get("content") is not None or out.get("role") != "assistant":
            out["content"] = message_text(out.get("content"))
        return out

    # -- generation ---------------------------------------------------------------------------

    def seed_for(self, prompt_ids: Sequence[int], index: int, params: SampleParams) -> int:
        """The per-sample seed: prompt ids, sample index (unless greedy) and the request seed."""
        digest = hashlib.blake2b(array.array("q", prompt_ids).tobytes(), digest_size=8)
        digest.update(f"{0 if params.greedy else index}:{params.seed}".encode())
        return int.from_bytes(digest.digest(), "little")

    def _plan(self, prompt_ids: tuple[int, ...], seed: int) -> str:
        """What the model says after a prompt given as token ids (raw text completion)."""
        parsed = parse_chatml(self.decode(prompt_ids))
        if parsed is not None:
            messages, tools = parsed
            return self.plan_chat(messages, tools, "auto", seed)
        rng = random.Random(seed)
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 24))]
        return " " + " ".join(words).capitalize() + "."

    def plan_chat(
        self, messages: Sequence[JSON], tools: Sequence[JSON], tool_choice: Any, seed: int
    ) -> str:
        """The assistant's next turn: the lookups the question needs (policy.py), then the
        answer their results give; for other questions, tool calls while rounds remain."""
        rng = random.Random(seed)
        functions = [t.get("function", t) for t in tools if isinstance(t, dict)]
        functions = [f for f in functions if isinstance(f, dict) and f.get("name")]
        if functions and tool_choice != "none" and not isinstance(tool_choice, dict):
            planned = self._plan_lookups(messages, functions, tool_choice, rng)
            if planned is not None:
                return planned
        first_user = next((m for m in messages if m.get("role") == "user"), {})
        target = 1 + int(hex_digest(message_text(first_user.get("content")), size=4), 16) % 3
        done = tool_rounds(messages)
        last_role = messages[-1].get("role") if messages else "user"
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        wants_call = last_role != "tool" or done < target
        if functions and tool_choice != "none" and (forced or (wants_call and done < 8)):
            if isinstance(tool_choice, dict):
                name = tool_choice.get("function", {}).get("name")
                functions = [f for f in functions if f["name"] == name] or functions
            function = rng.choice(functions)
            args = self._arguments(function.get("parameters") or {}, messages, rng)
            return _tool_call_text([(function["name"], args)])
        sentence = rng.choice(_SENTENCES)
        results = [m for m in messages if m.get("role") == "tool"]
        if results and last_role == "tool":
            snippet = ascii_text(message_text(results[-1].get("content")), 60)
            return f"Based on the tool results ({snippet}), here is the answer. {sentence}"
        user = next((m for m in reversed(messages) if m.get("role") == "user"), first_user)
        topic = ascii_text(message_text(user.get("content")), 40) or "your request"
        return f"Here is a short answer about {topic}. {sentence}"

    def _plan_lookups(
        self,
        messages: Sequence[JSON],
        functions: Sequence[JSON],
        tool_choice: Any,
        rng: random.Random,
    ) -> str | None:
        """The turn for a question the policy knows how to look up, or None."""
        question, asked_at = user_question(messages)
        planned = planned_calls(question, functions)
        if planned is None:
            return None
        since = messages[asked_at + 1 :]
        results = [message_text(m.get("content")) for m in since if m.get("role") == "tool"]
        pending = planned[len(results) :]
        if pending and tool_rounds(since) < 8:
            if not results and tool_choice != "required" and rng.random() < GUESS_RATE:
                return guess(question, rng)
            count = len(pending) if rng.random() < PARALLEL_RATE else 1
            calls = []
            for function, parameter, lookup in pending[:count]:
                args = self._arguments(function.get("parameters") or {}, messages, rng)
                wrong = rng.random() < MISTAKE_RATE
                args[parameter] = mistaken(lookup, rng) if wrong else lookup.value
                calls.append((str(function["name"]), args))
            return _tool_call_text(calls)
        if tool_choice == "required":
            return None
        return answer_from(results, asked_arguments(since))

    @staticmethod
    def _arguments(schema: JSON, messages: Sequence[JSON], rng: random.Random) -> JSON:
        user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        text = ascii_text(message_text(user.get("content")), 80)
        words = [w.strip(".,;:!?\"'()") for w in text.split()]
        words = [w for w in words if len(w) > 2] or ["example"]
        guessed = rng.choice(words[1:] or words)
        names_in_text = places_in(text)  # a sentence's first word is no name
        entity = names_in_text[-1] if names_in_text else guessed
        props = schema.get("properties") or {}
        names = schema.get("required") or list(props)
        args: JSON = {}
        for name in names:
            prop = props.get(name) or {}
            kind = prop.get("type", "string")
            if prop.get("enum"):
                args[name] = rng.choice(prop["enum"])
            elif kind == "integer":
                args[name] = rng.randint(1, 10)
            elif kind == "number":
                args[name] = round(rng.uniform(0, 100), 1)
            elif kind == "boolean":
                args[name] = rng.random() < 0.5
            elif kind == "array":
                args[name] = [entity]
            elif kind == "object":
                args[name] = {}
            else:
                args[name] = text if name in _QUERY_PARAMS else entity
        return args

    def _sample(self, plan: str, params: SampleParams, seed: int) -> Sample:
        """Token ids, per-token text and finish state for a planned answer."""
        ids = list(self.encode(plan, False))
        if self.split_words:
            ids = [piece for token in ids for piece in self._pieces(token)]
        if params.ignore_eos:  # keep "talking" until max_tokens
            filler = self.encode(" " + _SENTENCES[seed % len(_SENTENCES)], False)
            while len(ids) < params.max_tokens:
                ids.extend(filler)
        skip = params.skip_special_tokens
        deltas = ["" if skip and t in self.special_ids else self.token_text(t) for t in ids]
        finish = "length"
        stop_reason: int | str | None = None
        cut = len(ids)
        for i, token in enumerate(ids):
            if token in params.stop_token_ids:
                cut, finish, stop_reason = i + 1, "stop", token
                deltas[i] = ""
                break
        text_limit: int | None = None
        if params.stop:
            text = "".join(deltas[:cut])
            hits = [(text.find(s), s) for s in params.stop if s and s in text]
            if hits:
                pos, stop = min(hits)
                end, length = pos + len(stop), 0
                for i, delta in enumerate(deltas):
                    length += len(delta)
                    if length >= end:
                        cut, finish, stop_reason, text_limit = i + 1, "stop", stop, pos
                        break
        if finish == "length" and not params.ignore_eos and cut == len(ids):
            ids.append(self.eos_id)
            deltas.append("")
            cut, finish = len(ids), "stop"
        if cut > params.max_tokens:
            cut, finish, stop_reason, text_limit = params.max_tokens, "length", None, None
        ids, deltas = ids[:cut], deltas[:cut]
        if text_limit is not None:  # drop the matched stop string from the text
            kept, total = [], 0
            for delta in deltas:
                piece = delta[: max(0, text_limit - total)]
                kept.append(piece)
                total += len(piece)
            deltas = kept
        rng = random.Random(seed ^ 0x5EED)
        logprobs = tuple(-round(0.0001 + rng.random() ** 3 * 2.5, 4) for _ in ids)
        return Sample(tuple(ids), tuple(deltas), "".join(deltas), finish, stop_reason, logprobs)

    def candidates(self, token_id: int, logprob: float, count: int) -> list[tuple[int, float]]:
        """The sampled token (rank 1) and `count - 1` lower-ranked alternatives."""
        out = [(token_id, logprob)]
        for rank in range(1, max(count, 1)):
            alt = (token_id + 7919 * rank) % 151643
            out.append((alt, round(logprob - 0.75 * rank - 0.1, 4)))
        return out


def _tool_call_text(calls: Sequence[tuple[str, JSON]]) -> str:
    """Hermes `<tool_call>` blocks, one per call, as Qwen writes parallel calls."""
    blocks = []
    for name, arguments in calls:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}")
    return "\n".join(blocks)
