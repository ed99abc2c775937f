"""Between the assembler and the exporters: the sampler's decisions, and per-step accounting.

A call of a dropped sample is refused as it arrives (nothing more is kept of it). A closed
trajectory is exported at once, unless its sample is a top-N candidate: then it waits for the
end of its step, when the candidates still among the N smallest hashes are exported and the
others dropped. Waiting trajectories are bounded; one pushed out of the bound is dropped and
counted. When a step ends, a summary record says what it produced and what was kept: once,
whatever arrives later. A call or trajectory of a step already decided is late: the sampler
judges it against the step's kept samples (`Sampler.decide`), a kept one is exported with a
`late` annotation, and both are counted on /metrics (`outcome="late"` besides seen, kept or
dropped), not in the step's summary, which was written already.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from trace_proxy.trajectories.ledger import Ledger
from trace_proxy.trajectories.record import (
    Annotation,
    Record,
    RolloutKey,
    StepSummary,
    Trajectory,
)
from trace_proxy.trajectories.rewards import ExportedIndex, Outcome, apply, matches
from trace_proxy.trajectories.sampler import DECIDED_STEPS, Fate, Sampler, StepDecision

StepScope = tuple[str, str, bool, Any]  # project, experiment, validate, step
ENDED_STEPS = DECIDED_STEPS  # steps remembered as ended, so late arrivals never reopen one


def sample_of(key: RolloutKey) -> Any:
    """What a sample is: its index, else the hash of its first prompt, else the trajectory."""
    if key.sample_index is not None:
        return key.sample_index
    return key.sample_hash if key.sample_hash is not None else key.trajectory_id


def _rollout(key: RolloutKey) -> tuple[Any, Any]:
    return (sample_of(key), key.rollout_n if key.trajectory_id is None else key.trajectory_id)


def scope_of(key: RolloutKey) -> StepScope:
    return (key.project, key.experiment, bool(key.validate), key.step)


class SamplingGate:
    def __init__(
        self,
        sampler: Sampler,
        emit: Callable[[Record], None],
        *,
        max_waiting: int = 50_000,
        on_drop: Callable[[str, str], None] | None = None,
        on_count: Callable[[str, str, int], None] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self._ledger = ledger if ledger is not None else Ledger()
        self._on_count = on_count  # (calls|trajectories, seen|kept|dropped_by_sampler, n)
        self._sampler = sampler
        self._emit = emit
        self._max_waiting = max_waiting
        self._on_drop = on_drop
        self._summaries: OrderedDict[StepScope, StepSummary] = OrderedDict()
        self._waiting: OrderedDict[str, tuple[StepScope, Any, Trajectory]] = OrderedDict()
        # Per step, with a number of samples kept: the rollouts counted as seen and dropped
        # when a call of theirs was refused, and those a closed trajectory counted as seen.
        # A rollout pushed out after its first turns has both, and counts once.
        self._refused: dict[StepScope, set[tuple[Any, Any]]] = {}
        self._released: dict[StepScope, set[tuple[Any, Any]]] = {}
        self._exported = ExportedIndex()
        self._ended: OrderedDict[StepScope, None] = OrderedDict()  # the latest, bounded
        self._active = any(
            p.max_samples is not None or p.rate is not None
            for p in (sampler.policy(False), sampler.policy(True))
        )

    def give(self, decision: StepDecision) -> bool:
        """A step's kept samples, decided by whoever saw its whole batch (`Sampler.give`)."""
        return self._sampler.give(
            decision.experiment, decision.step, decision.validate, decision.kept
        )

    @property
    def active(self) -> bool:
        """Is anything being sampled out? (If not, there is nothing to decide early.)"""
        return self._active

    def admit(self, key: RolloutKey, counted: bool = True) -> bool:
        """Is a new call of this key worth keeping? `counted` False: a call whose content
        capture dropped, which the step summary's call counts leave out."""
        fate, _ = self._sampler.decide(key.experiment, key.step, bool(key.validate), sample_of(key))
        if not counted:
            return fate is not Fate.DROP
        scope = scope_of(key)
        if self._late(key):
            self._count("calls", "seen", 1)
            self._count("calls", "late", 1)
            if fate is Fate.DROP:
                self._count("calls", "dropped_by_sampler", 1)
                self._dropped("call", "sampler")
                return False
            return True
        summary = self._summary(scope)
        summary.calls_seen += 1
        self._count("calls", "seen", 1)
        if fate is not Fate.DROP:
            return True
        summary.calls_dropped_by_sampler += 1
        self._count("calls", "dropped_by_sampler", 1)
        refused = self._refused.setdefault(scope, set())
        rollout = _rollout(key)
        if rollout not in refused:
            refused.add(rollout)
            if rollout not in self._released.get(scope, ()):
                summary.trajectories_seen += 1
                self._count("trajectories", "seen", 1)
            summary.trajectories_dropped_by_sampler += 1
            self._count("trajectories", "dropped_by_sampler", 1)
        self._dropped("call", "sampler")
        return False

    def release(self, trajectory: Trajectory) -> None:
        """A closed trajectory: exported, held until its step ends, or dropped."""
        key = trajectory.key
        scope = scope_of(key)
        policy = self._sampler.policy(bool(key.validate))
        if self._late(key):
            self._release_late(trajectory)
            return
        rollout = _rollout(key)
        if rollout not in self._refused.get(scope, ()):
            self._summary(scope).trajectories_seen += 1
            self._count("trajectories", "seen", 1)
        if policy.max_samples is None:
            self._export(scope, trajectory)
            return
        self._released.setdefault(scope, set()).add(rollout)
        sample = sample_of(key)
        given = self._sampler.given(key.experiment, key.step, bool(key.validate), sample)
        if given is not None:  # the step's samples were named: no waiting for its end
            (self._export if given else self._drop)(scope, trajectory)
            return
        if not self._sampler.is_candidate(key.experiment, key.step, bool(key.validate), sample):
            self._drop(scope, trajectory)
            return
        self._waiting[trajectory.id] = (scope, sample, trajectory)
        while len(self._waiting) > self._max_waiting:
            _, (old_scope, _, oldest) = self._waiting.popitem(last=False)
            self._drop(old_scope, oldest, reason="waiting_full")

    def _late(self, key: RolloutKey) -> bool:
        """Has this key's step ended already (its summary written)?"""
        return scope_of(key) in self._ended

    def _release_late(self, trajectory: Trajectory) -> None:
        """A trajectory closed after its step was decided: judged against the step's kept
        samples, counted on /metrics only (its step's summary is written)."""
        key = trajectory.key
        fate, _ = self._sampler.decide(key.experiment, key.step, bool(key.validate), sample_of(key))
        self._count("trajectories", "seen", 1)
        self._count("trajectories", "late", 1)
        calls = len(trajectory.calls)
        if fate is Fate.DROP:
            self._count("trajectories", "dropped_by_sampler", 1)
            self._dropped("trajectory", "sampler")
            self._ledger.settle_record(trajectory)
            return
        trajectory.annotations.append(
            {"field": "step", "source": "sampler", "value": str(key.step),
             "note": "late: closed after its step ended and its summary was written; kept "
                     "by the rule that chose the step's samples"}
        )  # fmt: skip
        self._count("trajectories", "kept", 1)
        self._count("calls", "kept", calls)
        self._exported.add(trajectory)
        self._emit(trajectory)

    def end_step(self, project: str, experiment: str, validate: bool, step: Any) -> None:
        scope = (project, experiment, validate, step)
        kept = self._sampler.finish_step(experiment, step, validate)
        for record_id, (waiting_scope, sample, trajectory) in list(self._waiting.items()):
            if waiting_scope != scope:
                continue
            del self._waiting[record_id]
            if str(sample) in kept:
                self._export(scope, trajectory)
            else:
                self._drop(scope, trajectory)
        self._refused.pop(scope, None)
        self._released.pop(scope, None)
        self._ended[scope] = None
        while len(self._ended) > ENDED_STEPS:
            self._ended.popitem(last=False)
        summary = self._summaries.pop(scope, None)
        if summary is not None:
            self._emit(summary)

    def annotate(self, outcome: Outcome, project: str, experiment: str) -> str:
        """A reward for a trajectory that is no longer open: on its record if it still waits
        for its step, else an annotation record next to the exported one (or, when this proxy
        never exported it, next to where it would be)."""
        waiting = [t for _, _, t in self._waiting.values() if matches(t.key, outcome.target)]
        for trajectory in waiting:
            apply(trajectory, outcome)
        if waiting:
            return "waiting"
        found = self._exported.find(outcome.target)
        target = outcome.target
        key = found[0][1] if found else None
        self._emit(
            Annotation(
                project=key.project if key else target.get("project", project),
                experiment=key.experiment if key else target.get("experiment", experiment),
                step=key.step if key else target.get("step"),
                validate=bool(key.validate) if key else bool(target.get("validate", False)),
                target=target,
                trajectories=[record_id for record_id, _ in found],
                time=time.time(),
                reward=outcome.reward,
                score=outcome.score,
                labels=outcome.labels,
            )
        )
        return "exported" if found else "unknown"

    def end_steps_before(
        self,
        project: str,
        experiment: str,
        validate: bool,
        step: int,
        keep: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        """A later step has started: the earlier steps of the same run are over, except those
        in `keep` (some of their trajectories are still open)."""
        for scope in self._scopes():
            p, e, v, s = scope
            same_run = (p, e, v) == (project, experiment, validate)
            if same_run and s is not None and s < step and s not in keep:
                self.end_step(*scope)

    def end_all(self) -> None:
        for scope in self._scopes():
            self.end_step(*scope)

    def _scopes(self) -> list[StepScope]:
        waiting = (scope for scope, _, _ in self._waiting.values())
        return list(dict.fromkeys([*self._summaries, *waiting]))

    def _summary(self, scope: StepScope) -> StepSummary:
        summary = self._summaries.get(scope)
        if summary is None:
            project, experiment, validate, step = scope
            summary = self._summaries[scope] = StepSummary(project, experiment, step, validate)
        return summary

    def _export(self, scope: StepScope, trajectory: Trajectory) -> None:
        summary = self._summary(scope)
        summary.trajectories_kept += 1
        summary.calls_kept += len(trajectory.calls)
        self._count("trajectories", "kept", 1)
        self._count("calls", "kept", len(trajectory.calls))
        self._exported.add(trajectory)
        self._emit(trajectory)

    def _drop(self, scope: StepScope, trajectory: Trajectory, reason: str = "sampler") -> None:
        summary = self._summary(scope)
        if _rollout(trajectory.key) not in self._refused.get(scope, ()):  # else counted then
            summary.trajectories_dropped_by_sampler += 1
            self._count("trajectories", "dropped_by_sampler", 1)
        summary.calls_dropped_by_sampler += len(trajectory.calls)
        self._dropped("trajectory", reason)
        self._ledger.settle_record(trajectory)

    def _count(self, what: str, outcome: str, n: int) -> None:
        if self._on_count is not None and n:
            self._on_count(what, outcome, n)

    def _dropped(self, what: str, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(what, reason)
