"""Trajectories recovered from the traffic alone, for calls that carry no key.

- Continuation: a prompt that starts with an earlier call's prompt + response (token ids, text,
  or chat messages with that response as the assistant turn) continues that call's trajectory.
- Resume: AReaL re-POSTs prompt + the tokens generated so far after an interruption; a prompt
  that is exactly an aborted call's prompt + output is the same logical call, resumed.
- Groups: identical first prompts are one sample (GRPO group): `sample_hash` is a hash of the
  first prompt, and `rollout_n` numbers the group's rollouts in the order the proxy first saw
  them within the step (0, 1, ...).
- Steps: a weight update passing through the proxy (`/update_weights*`,
  `/finish_weight_update`, `/update_weight_version`), or a new `weight_version` reported in a
  response, starts the next step; steps count from 0 per experiment. A continuation keeps the
  step its trajectory started in (an asynchronous rollout can outlive an update).
Every inferred field says so in `key.sources` (`inferred:...`). State is bounded: the oldest
contexts are forgotten first, and each one forgotten is counted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from trace_proxy import safejson
from trace_proxy.trajectories.record import GenerateCall, RolloutKey, ids_list, output_text

BUCKET_ITEMS = 16  # a continuation shares its first prompt's first items


@dataclass
class _Context:
    trajectory_id: str
    step: int
    bucket: Hashable
    sequence: Sequence[Any] | str  # the prompt + response a continuation would start with
    last_finish: str | None
    sample_hash: str
    rollout_n: int


def _canonical_arguments(arguments: Any) -> str:
    """Tool arguments compared by value: clients re-serialise them with their own spacing."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    canonical: str = safejson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return canonical


def _canonical_message(message: Any) -> tuple[Any, ...]:
    """What makes two chat messages the same turn, whatever nulls or spacing a client adds.
    Hashable whatever the client sent: the turns are keys of the continuation index."""
    if not isinstance(message, dict):
        return ("?", str(message))
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    calls = message.get("tool_calls")
    functions = [
        c.get("function") for c in (calls if isinstance(calls, list) else []) if isinstance(c, dict)
    ]
    signature = tuple(
        (_key_part(f.get("name")), _canonical_arguments(f.get("arguments")))
        for f in (f if isinstance(f, dict) else {} for f in functions)
    )
    return (_key_part(message.get("role")), _key_part(content) or "", signature,
            _key_part(message.get("tool_call_id")))  # fmt: skip


def _key_part(value: Any) -> Hashable:
    """A scalar as it is; anything else as its JSON text."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return _canonical_arguments(value)


def _assistant_turn(call: GenerateCall) -> tuple[Any, ...]:
    first = call.outputs[0] if call.outputs else None
    return _canonical_message(
        {
            "role": "assistant",
            "content": first.text if first else None,
            "tool_calls": first.tool_calls if first else None,
        }
    )


def _sequence(call: GenerateCall) -> Sequence[Any] | str | None:
    """The prompt as the client wrote it: messages (chat: re-templated turns need not give back
    the generated token ids), else token ids, else text."""
    if call.prompt.messages is not None:
        return [_canonical_message(m) for m in call.prompt.messages]
    ids = ids_list(call.prompt.token_ids)
    return ids if ids is not None else call.prompt.text


def _with_response(call: GenerateCall, prompt: Sequence[Any] | str) -> Sequence[Any] | str:
    first = call.outputs[0] if call.outputs else None
    if isinstance(prompt, str):
        return prompt + (output_text(first) if first else "")
    if call.prompt.messages is not None:
        return [*prompt, _assistant_turn(call)]
    return [*prompt, *((first.token_ids or []) if first else [])]


def _digest(sequence: Sequence[Any] | str) -> str:
    data = sequence if isinstance(sequence, str) else list(sequence)
    return hashlib.blake2b(safejson.dumps(data), digest_size=8).hexdigest()


def _bucket(kind: str, sequence: Sequence[Any] | str, items: int) -> Hashable:
    head = sequence[:items] if isinstance(sequence, str) else tuple(sequence[:items])
    return (kind, head)


def _kind(sequence: Sequence[Any] | str) -> str:
    if isinstance(sequence, str):
        return "text"
    return "messages" if sequence and isinstance(sequence[0], tuple) else "tokens"


class TrafficInference:
    def __init__(self, max_contexts: int = 100_000, on_evict: Callable[[], None] | None = None):
        self._max_contexts = max_contexts
        self._on_evict = on_evict
        self._contexts: OrderedDict[str, _Context] = OrderedDict()
        self._buckets: dict[Hashable, set[str]] = {}
        self._short_heads: set[int] = set()  # first prompts shorter than BUCKET_ITEMS
        self._steps: dict[tuple[str, str], int] = {}
        self._update_pending: set[tuple[str, str]] = set()
        self._versions: dict[tuple[str, str], str] = {}
        self._rollouts: OrderedDict[tuple[str, str, int, str], int] = OrderedDict()

    def weight_update(self, project: str, experiment: str) -> None:
        """Seen a weight-update route: the next new rollout belongs to the next step."""
        self._update_pending.add((project, experiment))

    def place(self, key: RolloutKey, call: GenerateCall) -> None:
        """Fill in what `key` lacks (trajectory_id, step, sample_hash, rollout_n) from the
        traffic; nothing when the call has no prompt to go by. (Whether the call resumes an
        aborted one is the assembler's to see, from the calls themselves.)"""
        sequence = _sequence(call)
        if sequence is None:
            return
        scope = (key.project, key.experiment)
        self._note_version(scope, call.weight_version)
        context = self._continued(sequence)
        if context is not None:
            self._contexts.move_to_end(context.trajectory_id)
            context.sequence = _with_response(call, sequence)
            context.last_finish = call.outputs[0].finish_reason if call.outputs else None
            self._set(key, "trajectory_id", context.trajectory_id, "inferred:prefix")
            self._set(key, "step", context.step, "inferred:weight_updates")
            self._set(key, "sample_hash", context.sample_hash, "inferred:first_prompt")
            self._set(key, "rollout_n", context.rollout_n, "inferred:order_in_group")
            return
        step = self._current_step(scope)
        self._set(key, "step", step, "inferred:weight_updates")
        step = key.step if key.step is not None else step
        sample_hash = _digest(sequence)
        group = (key.project, key.experiment, step, sample_hash)
        rollout = self._rollouts.pop(group, 0)
        self._rollouts[group] = rollout + 1
        while len(self._rollouts) > self._max_contexts:
            self._rollouts.popitem(last=False)
        trajectory_id = f"inferred-{step}-{sample_hash}-{rollout}"
        self._set(key, "sample_hash", sample_hash, "inferred:first_prompt")
        self._set(key, "rollout_n", rollout, "inferred:order_in_group")
        self._set(key, "trajectory_id", trajectory_id, "inferred:new")
        self._remember(
            _Context(
                trajectory_id=trajectory_id,
                step=step,
                bucket=_bucket(_kind(sequence), sequence, BUCKET_ITEMS),
                sequence=_with_response(call, sequence),
                last_finish=call.outputs[0].finish_reason if call.outputs else None,
                sample_hash=sample_hash,
                rollout_n=rollout,
            ),
            len(sequence),
        )

    @staticmethod
    def _set(key: RolloutKey, name: str, value: Any, source: str) -> None:
        if getattr(key, name) is None:
            setattr(key, name, value)
            key.sources[name] = source

    def _note_version(self, scope: tuple[str, str], version: str | None) -> None:
        if version is None:
            return
        previous = self._versions.get(scope)
        self._versions[scope] = version
        if previous is not None and previous != version:
            self._update_pending.add(scope)

    def _current_step(self, scope: tuple[str, str]) -> int:
        step = self._steps.get(scope, 0)
        if scope in self._update_pending:
            self._update_pending.discard(scope)
            step += 1
            self._steps[scope] = step
        return step

    def _continued(self, sequence: Sequence[Any] | str) -> _Context | None:
        kind = _kind(sequence)
        best: _Context | None = None
        for items in (BUCKET_ITEMS, *sorted(self._short_heads)):
            for trajectory_id in self._buckets.get(_bucket(kind, sequence, items), ()):
                context = self._contexts[trajectory_id]
                known = context.sequence
                # Strictly longer (a new turn), or equal after an abort (a resumed generate).
                longer = len(known) < len(sequence) or (
                    len(known) == len(sequence) and context.last_finish == "abort"
                )
                extends = longer and sequence[: len(known)] == known
                if extends and (best is None or len(known) > len(best.sequence)):
                    best = context
        return best

    def _remember(self, context: _Context, first_prompt_items: int) -> None:
        self._contexts[context.trajectory_id] = context
        self._buckets.setdefault(context.bucket, set()).add(context.trajectory_id)
        if first_prompt_items < BUCKET_ITEMS:
            self._short_heads.add(first_prompt_items)
        while len(self._contexts) > self._max_contexts:
            _, oldest = self._contexts.popitem(last=False)
            members = self._buckets.get(oldest.bucket)
            if members is not None:
                members.discard(oldest.trajectory_id)
                if not members:
                    del self._buckets[oldest.bucket]
            if self._on_evict is not None:
                self._on_evict()
