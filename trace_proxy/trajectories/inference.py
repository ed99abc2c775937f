"""Trajectories recovered from the traffic alone, for calls that carry no key.

- Continuation: a prompt that starts with an earlier call's prompt + response (token ids, text,
  or chat messages with that response as the assistant turn) continues that call's trajectory.
  When several trajectories match equally well (a reply that came back as text only, so only
  the shared prompt matched; or rollouts that answered alike), the new ids are decoded and
  compared with each candidate's reply text; a call still not told apart starts a trajectory
  of its own (`inferred:ambiguous`): a wrong attachment is worse than none.
- Mapped ids: a trajectory id from a `--map` rule fixes the grouping only; step, sample_hash
  and rollout_n are inferred as for keyless traffic, once per mapped trajectory.
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
from typing import Any, Protocol

import orjson

from trace_proxy import safejson
from trace_proxy.trajectories.record import GenerateCall, RolloutKey, ids_list, output_text

BUCKET_ITEMS = 16  # a continuation shares its first prompt's first items
REPLY_CHARS = 1024  # of a text-only reply, kept to tell continuations apart
MAPPED_SOURCE = "map:"  # how a mapping rule names itself in `key.sources`


class Decoders(Protocol):
    """A decoder per served model, where one is known (token2text's `Tokenizers`)."""

    def for_model(self, model: str | None) -> Callable[[Sequence[int]], str] | None: ...


@dataclass
class _Context:
    trajectory_id: str
    step: int
    bucket: Hashable
    sequence: Sequence[Any] | str  # the prompt + response a continuation would start with
    last_finish: str | None
    sample_hash: str
    rollout_n: int | None
    reply: str | None = None  # a reply that came as text only (its ids are not in `sequence`)
    model: str | None = None


@dataclass
class _Mapped:
    """What was inferred for a trajectory a mapping rule names, from its first call."""

    step: int
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


def _text_reply(call: GenerateCall) -> str | None:
    """The first output's text when it came without token ids (what a continuation's new ids
    must decode to), capped."""
    first = call.outputs[0] if call.outputs else None
    if first is None or first.token_ids or not isinstance(first.text, str) or not first.text:
        return None
    return first.text[:REPLY_CHARS]


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


def _decodable(sequence: Sequence[Any] | str, candidates: list[_Context]) -> bool:
    """Could decoding tell these candidates apart? Token ids continuing replies that came as
    text (each candidate's)."""
    if isinstance(sequence, str) or _kind(sequence) != "tokens":
        return False
    return all(c.reply for c in candidates)


class TrafficInference:
    def __init__(
        self,
        max_contexts: int = 100_000,
        on_evict: Callable[[], None] | None = None,
        tokenizers: Decoders | None = None,
    ):
        """`tokenizers`: decoders for telling apart continuations of text-only replies; may
        be set (or filled) later, and may stay empty."""
        self.tokenizers = tokenizers
        self._max_contexts = max_contexts
        self._mapped: OrderedDict[tuple[str, str], _Mapped] = OrderedDict()
        self._on_evict = on_evict
        self._contexts: OrderedDict[str, _Context] = OrderedDict()
        self._buckets: dict[Hashable, set[str]] = {}
        self._short_heads: set[int] = set()  # first prompts shorter than BUCKET_ITEMS
        self._steps: dict[tuple[str, str], int] = {}
        self._update_pending: set[tuple[str, str]] = set()
        self._versions: dict[tuple[str, str], str] = {}
        self._rollouts: OrderedDict[tuple[str, str, int, str], int] = OrderedDict()
        self._ambiguous = 0  # trajectories started because a continuation was ambiguous

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
        found = self._continued(sequence, call.model)
        if isinstance(found, _Context):
            context = found
            self._contexts.move_to_end(context.trajectory_id)
            context.sequence = _with_response(call, sequence)
            context.last_finish = call.outputs[0].finish_reason if call.outputs else None
            context.reply = _text_reply(call)
            self._set(key, "trajectory_id", context.trajectory_id, "inferred:prefix")
            self._set(key, "step", context.step, "inferred:weight_updates")
            self._set(key, "sample_hash", context.sample_hash, "inferred:first_prompt")
            if context.rollout_n is not None:
                self._set(key, "rollout_n", context.rollout_n, "inferred:order_in_group")
            return
        if found:  # several trajectories match and nothing tells them apart
            self._start_ambiguous(key, call, sequence, found)
            return
        step = self._current_step(scope)
        self._set(key, "step", step, "inferred:weight_updates")
        step = key.step if key.step is not None else step
        sample_hash = _digest(sequence)
        rollout = self._next_rollout(key, step, sample_hash)
        trajectory_id = f"inferred-{step}-{sample_hash}-{rollout}"
        self._set(key, "sample_hash", sample_hash, "inferred:first_prompt")
        self._set(key, "rollout_n", rollout, "inferred:order_in_group")
        self._set(key, "trajectory_id", trajectory_id, "inferred:new")
        self._remember(self._context(trajectory_id, step, sample_hash, rollout, call, sequence),
                       len(sequence))  # fmt: skip

    def place_mapped(self, key: RolloutKey, call: GenerateCall) -> None:
        """A call whose trajectory id a mapping rule gave: the id groups it; step,
        sample_hash and rollout_n come from the trajectory's first call, inferred as for
        keyless traffic (the step when it started, the hash of its first prompt, its order
        in that group)."""
        if key.trajectory_id is None:
            return
        scope = (key.project, key.experiment)
        self._note_version(scope, call.weight_version)
        name = (key.project, key.trajectory_id)
        mapped = self._mapped.get(name)
        if mapped is None:
            sequence = _sequence(call)
            if sequence is None:
                return
            step = self._current_step(scope)
            step = key.step if key.step is not None else step
            sample_hash = _digest(sequence)
            mapped = _Mapped(step, sample_hash, self._next_rollout(key, step, sample_hash))
            self._mapped[name] = mapped
            while len(self._mapped) > self._max_contexts:
                self._mapped.popitem(last=False)
                if self._on_evict is not None:
                    self._on_evict()
        else:
            self._mapped.move_to_end(name)
        self._set(key, "step", mapped.step, "inferred:weight_updates")
        self._set(key, "sample_hash", mapped.sample_hash, "inferred:first_prompt")
        self._set(key, "rollout_n", mapped.rollout_n, "inferred:order_in_group")

    def forget_mapped(self, project: str, trajectory_id: str) -> None:
        """A mapped trajectory ended (done): the same id later is a new rollout."""
        self._mapped.pop((project, trajectory_id), None)

    def _next_rollout(self, key: RolloutKey, step: int, sample_hash: str) -> int:
        group = (key.project, key.experiment, step, sample_hash)
        rollout = self._rollouts.pop(group, 0)
        self._rollouts[group] = rollout + 1
        while len(self._rollouts) > self._max_contexts:
            self._rollouts.popitem(last=False)
        return rollout

    def _context(
        self,
        trajectory_id: str,
        step: int,
        sample_hash: str,
        rollout: int | None,
        call: GenerateCall,
        sequence: Sequence[Any] | str,
    ) -> _Context:
        return _Context(
            trajectory_id=trajectory_id,
            step=step,
            bucket=_bucket(_kind(sequence), sequence, BUCKET_ITEMS),
            sequence=_with_response(call, sequence),
            last_finish=call.outputs[0].finish_reason if call.outputs else None,
            sample_hash=sample_hash,
            rollout_n=rollout,
            reply=_text_reply(call),
            model=call.model,
        )

    def _start_ambiguous(
        self,
        key: RolloutKey,
        call: GenerateCall,
        sequence: Sequence[Any] | str,
        candidates: list[_Context],
    ) -> None:
        """A trajectory of its own, saying why; what every candidate agrees on (the step it
        started in, its sample) is still given, never a rollout number."""
        steps = {c.step for c in candidates}
        step = steps.pop() if len(steps) == 1 else self._current_step((key.project, key.experiment))
        hashes = {c.sample_hash for c in candidates}
        sample_hash = hashes.pop() if len(hashes) == 1 else _digest(sequence)
        self._ambiguous += 1
        trajectory_id = f"inferred-{step}-{sample_hash}-ambiguous{self._ambiguous}"
        self._set(key, "step", step, "inferred:weight_updates")
        self._set(key, "sample_hash", sample_hash, "inferred:first_prompt")
        self._set(key, "trajectory_id", trajectory_id, "inferred:ambiguous")
        self._remember(self._context(trajectory_id, step, sample_hash, None, call, sequence),
                       len(sequence))  # fmt: skip

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

    def _continued(
        self, sequence: Sequence[Any] | str, model: str | None, decode: bool = True
    ) -> _Context | list[_Context] | None:
        """The trajectory `sequence` continues; a list of the candidates when several match
        equally well and nothing tells them apart (without `decode`, nothing is tried);
        None when none matches."""
        kind = _kind(sequence)
        best: list[_Context] = []
        for items in (BUCKET_ITEMS, *sorted(self._short_heads)):
            for trajectory_id in self._buckets.get(_bucket(kind, sequence, items), ()):
                context = self._contexts[trajectory_id]
                known = context.sequence
                # Strictly longer (a new turn), or equal after an abort (a resumed generate).
                longer = len(known) < len(sequence) or (
                    len(known) == len(sequence) and context.last_finish == "abort"
                )
                if not (longer and sequence[: len(known)] == known):
                    continue
                if not best or len(known) > len(best[0].sequence):
                    best = [context]
                elif len(known) == len(best[0].sequence):
                    best.append(context)
        if not best:
            return None
        if len(best) == 1:
            return best[0]
        return self._by_reply(sequence, best, model) if decode else best

    def needs_decoder(self, call: GenerateCall) -> bool:
        """Would placing `call` tell rollouts apart by decoding its new ids, with no decoder
        for its model yet? (Asked while the tokenizer loads: such a call waits for it rather
        than start a trajectory marked ambiguous.)"""
        sequence = _sequence(call)
        if sequence is None:
            return False
        found = self._continued(sequence, call.model, decode=False)
        if not isinstance(found, list) or not _decodable(sequence, found):
            return False
        return self.tokenizers is None or self.tokenizers.for_model(call.model) is None

    def _by_reply(
        self, sequence: Sequence[Any] | str, candidates: list[_Context], model: str | None
    ) -> _Context | list[_Context]:
        """The one candidate whose text-only reply the new ids decode to, if exactly one.
        Only token ids need this: text and chat prompts carry the reply itself."""
        if not _decodable(sequence, candidates):
            return candidates
        decode = self.tokenizers.for_model(model) if self.tokenizers is not None else None
        if decode is None:
            return candidates
        replies = [c.reply for c in candidates]
        start = len(candidates[0].sequence)
        longest = max(len(r) for r in replies if r)
        try:
            text = decode([int(i) for i in sequence[start : start + longest + 16]])
        except Exception:  # a tokenizer that cannot decode these ids tells nothing
            return candidates
        matching = [c for c in candidates if c.reply and text.startswith(c.reply)]
        return matching[0] if len(matching) == 1 else candidates

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
