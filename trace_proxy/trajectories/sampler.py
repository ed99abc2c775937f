"""Deterministic per-step sampling of trajectories, consistent across replicas and restarts.

verl keeps `max_samples_per_step_per_worker` samples with an unseeded random choice per worker;
here a sample's fate depends only on a keyed hash of (seed, experiment, step, validate, sample):

- rate mode (`--sample-rate P`): keep a sample when its hash is below P. No state, no
  buffering, the same answer on every replica.
- top-N mode (`--max-samples-per-step N`): keep the N samples of the step with the smallest
  hashes. Decided as traffic arrives: a sample whose hash is above the step's current N-th
  smallest is dropped at once; the others are candidates until the step ends, and a candidate
  pushed out by N smaller hashes is dropped then. The kept set is the N smallest of all samples
  seen, whatever the arrival order, on one replica or split across many (each replica keeps the
  N smallest of what it saw, and the N smallest overall are among them).
- `None` keeps everything; 0 keeps nothing. Whole samples are kept: every rollout of a kept
  sample (a whole GRPO group).
- A top-N step may also be decided by whoever sees its whole batch (verl's agent-loop manager,
  in front of a proxy per node): `give` names its kept samples, and every other sample of that
  step is dropped from its first call. Each proxy then keeps exactly what the manager chose,
  so N samples are kept per step across any number of proxies, not N per proxy.
- A step once decided stays decided (the latest DECIDED_STEPS are remembered): a sample that
  arrives after its step ended is judged against what was kept, kept when it is one of the
  kept samples or would have been among the N smallest (fewer than N kept, or its hash below
  the largest kept), dropped otherwise. What was exported is never taken back, so a late
  sample can only add to the step's selection, never replace one already kept.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

HASH_SPACE = float(1 << 64)
DECIDED_STEPS = 4096  # steps whose selection late samples are judged against


class Fate(str, Enum):
    KEEP = "keep"  # final
    DROP = "drop"  # final
    CANDIDATE = "candidate"  # top-N: kept unless N smaller hashes arrive before the step ends


def sample_hash(seed: int, experiment: str, step: int | None, validate: bool, sample: Any) -> float:
    """A keyed hash in [0, 1); the seed is the key, so another seed gives another selection."""
    message = f"{experiment}\x1f{step}\x1f{int(validate)}\x1f{sample}".encode()
    digest = hashlib.blake2b(message, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / HASH_SPACE


@dataclass(frozen=True, slots=True)
class Policy:
    """One mode: at most one of `max_samples` and `rate` is set (neither: keep all)."""

    max_samples: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        if self.max_samples is not None and self.rate is not None:
            raise ValueError("choose either a number of samples per step or a sample rate")
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError("the number of samples per step cannot be negative")
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError("the sample rate is a fraction between 0 and 1")


@dataclass
class _Step:
    """Top-N state of one (experiment, step, validate): a max-heap of the N smallest hashes."""

    heap: list[tuple[float, str]] = field(default_factory=list)  # (-hash, sample)
    members: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Decided:
    """A top-N step after its end: what was kept, and the bar a late sample must pass."""

    kept: frozenset[str]
    largest: float  # the largest kept hash (meaningful when full)
    full: bool  # N samples were kept

    def keeps(self, sample: str, h: float) -> bool:
        return sample in self.kept or not self.full or h < self.largest


StepId = tuple[str, Any, bool]  # experiment, step, validate


class Sampler:
    def __init__(self, seed: int = 0, train: Policy = Policy(), validate: Policy = Policy()):
        self.seed = seed
        self._policies = {False: train, True: validate}
        self._steps: dict[StepId, _Step] = {}
        self._decided: OrderedDict[StepId, _Decided] = OrderedDict()
        self._given: OrderedDict[StepId, set[str]] = OrderedDict()  # see `give`

    def policy(self, validate: bool) -> Policy:
        return self._policies[validate]

    def decide(
        self, experiment: str, step: int | None, validate: bool, sample: Any
    ) -> tuple[Fate, list[str]]:
        """The sample's fate now, and the candidates it pushed out (dropped from now on)."""
        policy = self._policies[validate]
        if policy.rate is None and policy.max_samples is None:
            return Fate.KEEP, []
        h = sample_hash(self.seed, experiment, step, validate, sample)
        if policy.rate is not None:
            return (Fate.KEEP if h < policy.rate else Fate.DROP), []
        assert policy.max_samples is not None
        if policy.max_samples == 0:
            return Fate.DROP, []
        name = str(sample)
        given = self._given.get((experiment, step, validate))
        if given is not None:
            return (Fate.KEEP if name in given else Fate.DROP), []
        decided = self._decided.get((experiment, step, validate))
        if decided is not None:
            return (Fate.KEEP if decided.keeps(name, h) else Fate.DROP), []
        state = self._steps.setdefault((experiment, step, validate), _Step())
        if name in state.members:
            return Fate.CANDIDATE, []
        if len(state.heap) < policy.max_samples:
            heapq.heappush(state.heap, (-h, name))
            state.members.add(name)
            return Fate.CANDIDATE, []
        largest = -state.heap[0][0]
        if h >= largest:
            return Fate.DROP, []
        _, evicted = heapq.heapreplace(state.heap, (-h, name))
        state.members.discard(evicted)
        state.members.add(name)
        return Fate.CANDIDATE, [evicted]

    def give(self, experiment: str, step: int | None, validate: bool, kept: Iterable[Any]) -> bool:
        """The step's kept samples, as decided by whoever saw its whole batch: these are kept,
        every other sample of the step dropped (final). A later call adds to what is kept (a
        step whose batch came in parts). False when this kind of step keeps every sample or
        samples by rate here: no top-N to decide, nothing is changed."""
        if self._policies[validate].max_samples is None:
            return False
        step_id = (experiment, step, validate)
        given = self._given.get(step_id)
        if given is None:
            given = self._given[step_id] = set()
            while len(self._given) > DECIDED_STEPS:
                self._given.popitem(last=False)
        given.update(str(sample) for sample in kept)
        return True

    @property
    def refuses_alone(self) -> bool:
        """Does a policy refuse samples without state (a rate, or none kept)? Then any
        process with the same settings can tell those refusals itself (`refused`)."""
        return any(p.rate is not None or p.max_samples == 0 for p in self._policies.values())

    def refused(self, experiment: str, step: int | None, validate: bool, sample: Any) -> bool:
        """Dropped whatever else arrives, decided without state: the rate says so, or the
        policy keeps no sample. (A top-N refusal depends on the samples seen before.)"""
        policy = self._policies[validate]
        if policy.max_samples == 0:
            return True
        if policy.rate is None:
            return False
        return sample_hash(self.seed, experiment, step, validate, sample) >= policy.rate

    def given(self, experiment: str, step: int | None, validate: bool, sample: Any) -> bool | None:
        """Whether the sample is kept, when its step's samples were named (`give`); else None."""
        given = self._given.get((experiment, step, validate))
        return None if given is None else str(sample) in given

    def is_candidate(self, experiment: str, step: int | None, validate: bool, sample: Any) -> bool:
        state = self._steps.get((experiment, step, validate))
        return state is not None and str(sample) in state.members

    def finish_step(self, experiment: str, step: int | None, validate: bool) -> set[str]:
        """The step is over: its candidates are kept. Returns them; the step is remembered as
        decided, so samples arriving later are judged against them."""
        step_id = (experiment, step, validate)
        decided = self._decided.get(step_id)
        if decided is not None:
            return set(decided.kept)
        state = self._steps.pop(step_id, None)
        max_samples = self._policies[validate].max_samples
        if max_samples is None or max_samples == 0:
            return set()
        given = self._given.get(step_id)
        if given is not None:  # nothing else is kept, late or not
            self._remember(step_id, _Decided(frozenset(given), 0.0, True))
            return set(given)
        kept = frozenset(state.members) if state is not None else frozenset()
        largest = -state.heap[0][0] if state is not None and state.heap else 0.0
        self._remember(step_id, _Decided(kept, largest, len(kept) >= max_samples))
        return set(kept)

    def _remember(self, step_id: StepId, decided: _Decided) -> None:
        self._decided[step_id] = decided
        while len(self._decided) > DECIDED_STEPS:
            self._decided.popitem(last=False)


class SamplingSettings(Protocol):
    """The options a sampler is made of (the proxy's `Settings` has them)."""

    sample_seed: int
    max_samples_per_step: int | None
    sample_rate: float | None
    validate_max_samples_per_step: int | None
    validate_sample_rate: float | None


def sampler_of(settings: SamplingSettings) -> Sampler:
    """The sampler the settings describe (training and validation policies)."""
    return Sampler(
        settings.sample_seed,
        train=Policy(settings.max_samples_per_step, settings.sample_rate),
        validate=Policy(settings.validate_max_samples_per_step, settings.validate_sample_rate),
    )


class DecisionError(ValueError):
    """A step's sampling decision the proxy cannot take; the message says what to fix."""


@dataclass(frozen=True)
class StepDecision:
    """`POST /sampling` on the admin port: the samples of one step to keep (see `give`)."""

    experiment: str
    step: int
    validate: bool
    kept: tuple[int | str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"experiment": self.experiment, "step": self.step, "validate": self.validate,
                "kept": list(self.kept)}  # fmt: skip


MAX_KEPT = 1 << 20


def parse_decision(payload: Any) -> StepDecision:
    """`{"experiment": str, "step": int, "validate": bool, "kept": [sample index, ...]}`."""
    if not isinstance(payload, dict):
        raise DecisionError("the body must be a JSON object")
    unknown = set(payload) - {"experiment", "step", "validate", "kept"}
    if unknown:
        raise DecisionError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    experiment, step = payload.get("experiment"), payload.get("step")
    validate, kept = payload.get("validate", False), payload.get("kept")
    if not isinstance(experiment, str) or not experiment:
        raise DecisionError("'experiment' must be a non-empty string")
    if isinstance(step, bool) or not isinstance(step, int):
        raise DecisionError("'step' must be an integer")
    if not isinstance(validate, bool):
        raise DecisionError("'validate' must be true or false")
    if not isinstance(kept, list) or len(kept) > MAX_KEPT:
        raise DecisionError(f"'kept' must be a list of at most {MAX_KEPT} sample indices")
    if any(isinstance(k, bool) or not isinstance(k, (int, str)) for k in kept):
        raise DecisionError("'kept' holds sample indices (integers or strings)")
    return StepDecision(experiment, step, validate, tuple(kept))
