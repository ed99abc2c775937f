"""Groups calls into trajectories and decides when a trajectory is complete.

A trajectory is identified by its `trajectory_id` when the client names one, else by
(experiment, step, validate, sample_index, rollout_n). It closes on the client's done flag, when
a later step of the same experiment starts, after `idle_timeout` without a call, when the
open-trajectory bound is reached (oldest first), or at shutdown. A call that arrives for an
already-closed trajectory opens a new part of it (`part` = 2, 3, ...), so nothing is lost.
Calls with no key at all are single-call trajectories.

A capture process started in place of one that died (`follow_restart`) cannot know what that
one held: each trajectory it opens, in its first `idle_timeout`, without having seen it before
carries a restart mark (`restart_mark`), so readers join it with this proxy's earlier record
of the same trajectory, if the dead process had written one. Later, a trajectory the dead one
held would have been closed as idle anyway; and a key the traffic inferred (`inferred:*`) is
never marked: the new process numbers steps and rollouts afresh, so the same inferred key
may name another rollout.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

from trace_proxy.trajectories.building import (
    OpenTrajectory,
    awaits_resume,
    build_trajectory,
    fill_missing,
    merge_resumed,
    resumes,
    sample_group,
    share_ids,
)
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.inference import MAPPED_SOURCE, TrafficInference
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.ledger import Ledger
from trace_proxy.trajectories.record import (
    WEIGHT_UPDATE_EVENTS,
    GenerateCall,
    Record,
    RolloutKey,
    StepEvent,
    ToolCall,
    new_record_id,
    restart_mark,
)
from trace_proxy.trajectories.rewards import Outcome, matches
from trace_proxy.trajectories.versions import newer

# The first prompts remembered per sample, for its other rollouts (see `latest_prompt`): the
# latest samples' (a group's rollouts start close together), at most so many and so large.
FIRST_PROMPTS = 1024
FIRST_PROMPTS_BYTES = 32 << 20
_KEY_FIELDS = ("step", "sample_index", "rollout_n")  # what names a trajectory without an id


def _mapped_id(key: RolloutKey) -> bool:
    """The trajectory id came from a `--map` rule: it groups, the rest is still inferred."""
    return key.trajectory_id is not None and key.sources.get("trajectory_id", "").startswith(
        MAPPED_SOURCE
    )


class Assembler:
    def __init__(
        self,
        emit: Callable[[Record], None],
        *,
        project: str,
        experiment: str,
        idle_timeout: float,
        max_open: int = 100_000,
        on_close: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        inference: TrafficInference | None = None,
        gate: SamplingGate | None = None,
        step_close_grace: float = 0.0,
        defer_finishing: bool = False,
        ledger: Ledger | None = None,
        key_notes: Callable[[RolloutKey], list[dict[str, Any]]] | None = None,
    ) -> None:
        """`defer_finishing`: closed trajectories are built, sampled and emitted later, by
        `run_pending`, in order, so a step change closing thousands of them at once can be
        spread over many turns of the event loop instead of stalling it. `key_notes`: the
        annotations a record gets from its key as it is built (the store's names for its
        project and experiment, `store.names.store_name_notes`)."""
        self._step_close_grace = step_close_grace
        self._defer = defer_finishing
        self._ledger = ledger if ledger is not None else Ledger()
        self._pending: deque[Callable[[], None]] = deque()
        # Closed, waiting in `_pending` to be finished.
        self._closing: dict[str, OpenTrajectory] = {}
        self._inference = inference
        self._gate = gate
        self._key_notes = key_notes
        self._emit = emit
        self._project = project
        self._experiment = experiment
        self._idle_timeout = idle_timeout
        self._max_open = max_open
        self._on_close = on_close
        self._clock = clock
        self._open: OrderedDict[Hashable, OpenTrajectory] = OrderedDict()
        self._parts: OrderedDict[Hashable, int] = OrderedDict()  # closed identities, bounded
        self._latest_step: dict[tuple[str, str, bool], int] = {}
        self._first_prompts: OrderedDict[Hashable, tuple[bytes, int]] = OrderedDict()
        self._first_prompts_bytes = 0
        self._restart_since: float | None = None  # see `follow_restart`
        self._restart_marks_until = 0.0
        # The newest policy version seen per run (project, experiment), in calls and events;
        # under None, the server's: an event that names no run (a trainer's weight update
        # through the proxy, without run headers) is a version of every run it serves.
        self._latest_version: dict[tuple[str, str] | None, str] = {}

    def follow_restart(self, since: float) -> None:
        """This process replaces a capture process of the same proxy (started at `since`, wall
        clock) that died with its open trajectories."""
        self._restart_since = since
        self._restart_marks_until = self._clock() + self._idle_timeout

    def _may_continue(self, key: RolloutKey) -> bool:
        """May a trajectory first seen now have begun in the capture process this one
        replaced, under a key that names it alike in both?"""
        if self._restart_since is None or self._clock() > self._restart_marks_until:
            return False
        names = ("trajectory_id",) if key.trajectory_id is not None else _KEY_FIELDS
        return not any(key.sources.get(name, "").startswith("inferred") for name in names)

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def pending(self) -> int:
        """Closed trajectories (and step ends) not yet finished."""
        return len(self._pending)

    def run_pending(self, until: float | None = None) -> None:
        """Finish what was closed, in order: all of it, or (at least one item) until
        `time.perf_counter()` passes `until`."""
        pending = self._pending
        while pending:
            pending.popleft()()
            if until is not None and time.perf_counter() >= until:
                return

    def _later(self, action: Callable[[], None]) -> None:
        if self._defer:
            self._pending.append(action)
        else:
            action()

    def _see_version(self, run: tuple[str, str] | None, version: str | None) -> None:
        if version is None:
            return
        latest = self._latest_version
        seen = latest.get(run, latest.get(None))  # a run new to the proxy: the server's so far
        latest[run] = newer(seen, version) or version

    def _finish_later(self, trajectory: OpenTrajectory, reason: str) -> None:
        run = (trajectory.key.project, trajectory.key.experiment)
        latest = self._latest_version
        trajectory.weight_version_latest = latest.get(run, latest.get(None))
        if self._defer:
            self._closing[trajectory.id] = trajectory
        self._later(partial(self._finish, trajectory, reason))

    @property
    def samples_early(self) -> bool:
        """Can `admit_early` drop anything? (Not when every sample is kept.)"""
        return self._gate is not None and self._gate.active

    def admit_early(self, hints: KeyHints) -> bool | None:
        """The sampler's verdict from headers alone, before anything is copied: True (keep;
        counted), False (dropped; counted), None (the headers name no sample, or nothing is
        sampled: decided after parsing)."""
        if self._gate is None or not self._gate.active or "sample_index" not in hints.values:
            return None
        return self._gate.admit(self._key(hints))

    def see_step(self, hints: KeyHints) -> None:
        """A call the sampler refused from its headers names this step: a later step may have
        started. Told in the order calls reach the assembler (see `CaptureStage.admit`), never
        ahead of calls that arrived before it, so a step never ends before they are placed."""
        self._close_older_steps(self._key(hints))

    def add_call(
        self,
        hints: KeyHints,
        call: GenerateCall,
        admitted: bool = False,
        ids_text: bytes | None = None,
    ) -> None:
        """`admitted`: the sampler already let this call in (see `admit_early`). `ids_text`:
        the JSON text the call's prompt ids were decoded from (see `decode_request`)."""
        key, hints.key = hints.key or self._key(hints), None
        self._see_version((key.project, key.experiment), call.weight_version)
        if self._inference is not None:
            if self._identity(key) is None:
                self._inference.place(key, call)
            elif _mapped_id(key):
                self._inference.place_mapped(key, call)
        found = self._destination(key, hints, admitted)
        if found is None:
            self._ledger.settle()  # the sampler's refusal, counted
            return
        trajectory, single = found
        trajectory.units += 1
        latest = trajectory.latest
        if latest is not None and resumes(latest, call, trajectory.full_latest_ids):
            merge_resumed(latest, call)
        else:
            share_ids(trajectory, latest, call, ids_text)
            trajectory.calls.append(call)
            if latest is None and trajectory.latest_text is not None:
                self._remember_first_prompt(key, trajectory.latest_text, trajectory.latest_count)
        if single:
            self._finish_later(trajectory, "single_call")
        elif hints.values.get("done") is True:
            del self._open[self._identity(trajectory.key)]
            self._close(trajectory, "done")

    def needs_decoder(self, hints: KeyHints, call: GenerateCall) -> bool:
        """Would `add_call` have to decode `call`'s new ids to tell rollouts apart, with no
        tokenizer for its model yet (see `TrafficInference.needs_decoder`)?"""
        if self._inference is None:
            return False
        key = hints.key = hints.key or self._key(hints)
        return self._identity(key) is None and self._inference.needs_decoder(call)

    def latest_prompt(self, hints: KeyHints) -> tuple[bytes, int] | None:
        """The JSON text of the latest prompt ids the open trajectory `hints` names holds,
        already known to be ids, and how many (see `decode_request`). Before its first call:
        the first prompt of another rollout of the same sample (GRPO sends the same one to
        all), so that one is neither decoded nor held again."""
        key = hints.key = self._key(hints)
        identity = self._identity(key)
        trajectory = self._open.get(identity) if identity is not None else None
        if trajectory is not None and trajectory.latest is not None:
            if trajectory.latest_text is None:
                return None
            return trajectory.latest_text, trajectory.latest_count
        group = sample_group(key)
        return self._first_prompts.get(group) if group is not None else None

    def _remember_first_prompt(self, key: RolloutKey, text: bytes, count: int) -> None:
        group = sample_group(key)
        if group is None or group in self._first_prompts:
            return
        self._first_prompts[group] = (text, count)
        self._first_prompts_bytes += len(text)
        prompts = self._first_prompts
        while len(prompts) > 1 and (
            len(prompts) > FIRST_PROMPTS or self._first_prompts_bytes > FIRST_PROMPTS_BYTES
        ):
            _, (old, _) = prompts.popitem(last=False)
            self._first_prompts_bytes -= len(old)

    def end(self, hints: KeyHints) -> None:
        """The client says the trajectory `hints` names is over (as `X-Rollout-Done` on its
        last call would): closed as done now, not at the idle timeout."""
        key = self._key(hints)
        identity = self._identity(key)
        if identity is None:
            return
        trajectory = self._open.pop(identity, None)
        if trajectory is not None:
            self._close(trajectory, "done")
        elif self._inference is not None and _mapped_id(key):
            assert key.trajectory_id is not None
            self._inference.forget_mapped(key.project, key.trajectory_id)

    def add_dropped(
        self, hints: KeyHints, start: float, end: float | None, admitted: bool = False
    ) -> None:
        """A call forwarded but not recorded (capture dropped its bodies; the drop and its
        reason are counted where it happened): its trajectory says a call is missing
        (`summary.calls_dropped`) and spans its time, and its done flag still closes it, so
        it does not wait for the next step holding its prompts. A trajectory of dropped
        calls alone is still a record, with no calls: the sample it belongs to is not
        missing from the step. `admitted` as for `add_call`: the sampler still decides."""
        key = self._key(hints)
        identity = self._identity(key)
        if identity is None:
            return  # no key: its own trajectory would hold nothing
        if self._gate is not None and not admitted and not self._gate.admit(key, counted=False):
            self._close_older_steps(key)
            return
        trajectory = self._attach(key, hints)
        assert trajectory is not None
        trajectory.dropped += 1
        end = start if end is None else end
        span = trajectory.dropped_span
        trajectory.dropped_span = (start, end) if span is None else (
            min(span[0], start), max(span[1], end))  # fmt: skip
        if hints.values.get("done") is True:
            del self._open[identity]
            self._close(trajectory, "done")

    def add_tool(self, hints: KeyHints, tool: ToolCall) -> None:
        """A tool call seen directly (an HTTP tool server routed through the proxy)."""
        found = self._destination(self._key(hints), hints, admitted=False)
        if found is None:
            self._ledger.settle()
            return
        trajectory, single = found
        trajectory.units += 1
        trajectory.tools.append(tool)
        if single:
            self._finish_later(trajectory, "single_call")

    def _destination(
        self, key: RolloutKey, hints: KeyHints, admitted: bool
    ) -> tuple[OpenTrajectory, bool] | None:
        """Where a new call goes: None (the sampler drops it), the open trajectory its key
        names, or (True) a trajectory of its own when the key names none."""
        if self._gate is not None and not admitted and not self._gate.admit(key):
            self._close_older_steps(key)
            return None
        trajectory = self._attach(key, hints)
        if trajectory is None:
            return self._new(key, hints), True
        return trajectory, False

    def _new(self, key: RolloutKey, hints: KeyHints, part: int = 1) -> OpenTrajectory:
        return OpenTrajectory(
            new_record_id(), key, part, self._clock(), annotations=list(hints.annotations)
        )

    def _attach(self, key: RolloutKey, hints: KeyHints) -> OpenTrajectory | None:
        """The open trajectory `key` names, opened if new; None when it names none."""
        identity = self._identity(key)
        now = self._clock()
        self._close_older_steps(key)
        if identity is None:
            return None
        trajectory = self._open.get(identity)
        if trajectory is None:
            part = self._parts.pop(identity, 0) + 1
            trajectory = OpenTrajectory(new_record_id(), key, part, now)
            if part == 1 and self._may_continue(key):
                assert self._restart_since is not None
                trajectory.annotations.append(restart_mark(self._restart_since))
            self._open[identity] = trajectory
            if len(self._open) > self._max_open:
                _, oldest = self._open.popitem(last=False)
                self._close(oldest, "evicted")
        else:
            self._open.move_to_end(identity)
            fill_missing(trajectory.key, key)
        trajectory.annotations.extend(hints.annotations)
        trajectory.last_activity = now
        return trajectory

    def annotate(self, outcome: Outcome) -> str:
        """Attach a reward/score/labels: `open`, `waiting`, `exported` or `unknown` (recorded
        all the same) says where the trajectory was. `done` closes the trajectory it names
        by `trajectory_id` or by its whole key, when open."""
        target = outcome.target
        project = target.get("project", self._project)
        direct: tuple[Any, ...] | None = None
        if "trajectory_id" in target:
            direct = ("id", project, target["trajectory_id"])
        elif {"experiment", "step", "sample_index", "rollout_n"} <= target.keys():
            direct = (
                "key", project, target["experiment"], target["step"],
                bool(target.get("validate", False)), target["sample_index"], target["rollout_n"],
            )  # fmt: skip
        hits = [self._open[direct]] if direct in self._open else []
        if direct is None:
            hits = [t for t in self._open.values() if matches(t.key, target)]
        if not hits:  # closed but not yet built: the outcome still goes into its record
            hits = [
                t
                for t in self._closing.values()
                if (self._identity(t.key) == direct if direct else matches(t.key, target))
            ]
        if outcome.done and direct is not None and direct in self._open:
            trajectory = self._open.pop(direct)
            if outcome.attaches:
                trajectory.outcomes.append(outcome)
            self._close(trajectory, "done")
            return "open"
        if outcome.attaches:
            for trajectory in hits:
                trajectory.outcomes.append(outcome)
        if hits:
            return "open"
        if not outcome.attaches:  # a `done` for nothing open: nothing to record
            return "unknown"
        if self._gate is None:
            return "unknown"
        return self._gate.annotate(outcome, project, target.get("experiment", self._experiment))

    def add_event(self, event: StepEvent) -> None:
        run = (event.project, event.experiment)
        named = run != (self._project, self._experiment)  # else no run header: the server's
        for each in [run] if named else [*self._latest_version, None]:
            self._see_version(each, event.weight_version)
        if event.event in WEIGHT_UPDATE_EVENTS and self._inference is not None:
            self._inference.weight_update(event.project, event.experiment)
        self._ledger.hold(event, 1)
        self._later(partial(self._emit, event))

    def close_idle(self) -> None:
        """Periodic: close trajectories idle for `idle_timeout`, and those of finished steps
        idle for `step_close_grace`."""
        now = self._clock()
        deadline = now - self._idle_timeout
        while self._open:
            identity, oldest = next(iter(self._open.items()))
            if oldest.last_activity > deadline:
                break
            del self._open[identity]
            self._close(oldest, "idle")
        self._close_finished_steps(now)

    def close_all(self, reason: str = "shutdown") -> None:
        while self._open:
            _, trajectory = self._open.popitem(last=False)
            self._close(trajectory, reason)
        if self._gate is not None:
            self._later(self._gate.end_all)
        self.run_pending()

    def _key(self, hints: KeyHints) -> RolloutKey:
        v = hints.values
        sources = {k: s for k, s in hints.sources.items() if k != "done"}
        if "project" not in v:
            sources["project"] = "config"
        if "experiment" not in v:
            sources["experiment"] = "config"
        return RolloutKey(
            project=v.get("project", self._project),
            experiment=v.get("experiment", self._experiment),
            step=v.get("step"),
            sample_index=v.get("sample_index"),
            rollout_n=v.get("rollout_n"),
            validate=v.get("validate"),
            trajectory_id=v.get("trajectory_id"),
            sample_id=v.get("sample_id"),
            sources=sources,
        )

    @staticmethod
    def _identity(key: RolloutKey) -> Hashable | None:
        if key.trajectory_id is not None:
            return ("id", key.project, key.trajectory_id)
        if key.sample_index is not None:
            return (
                "key", key.project, key.experiment, key.step, bool(key.validate),
                key.sample_index, key.rollout_n,
            )  # fmt: skip
        return None

    def _close_older_steps(self, key: RolloutKey) -> None:
        if key.step is None:
            return
        scope = (key.project, key.experiment, bool(key.validate))
        latest = self._latest_step.get(scope)
        if latest is not None and key.step <= latest:
            return
        self._latest_step[scope] = key.step
        if latest is not None:
            self._close_finished_steps(self._clock())

    def _close_finished_steps(self, now: float) -> None:
        """Trajectories of a step older than their run's latest are closed once idle for
        `step_close_grace` (an asynchronous rollout can outlive a weight update), except one
        whose last call was aborted: it will be resumed, so only the idle timeout closes it.
        A step ends (sampling decided, summary written) when none of its trajectories is open."""
        if not self._latest_step:
            return
        quiet_since = now - self._step_close_grace
        still_open: set[tuple[str, str, bool, int]] = set()
        for identity, t in list(self._open.items()):
            scope = (t.key.project, t.key.experiment, bool(t.key.validate))
            latest = self._latest_step.get(scope)
            if latest is None or t.key.step is None or t.key.step >= latest:
                continue
            if t.last_activity <= quiet_since and not awaits_resume(t):
                del self._open[identity]
                self._close(t, "step_change")
            else:
                still_open.add((*scope, t.key.step))
        if self._gate is not None:
            for run, latest in self._latest_step.items():
                keep = {step for *open_run, step in still_open if tuple(open_run) == run}
                self._later(partial(self._gate.end_steps_before, *run, latest, keep=keep))

    def _close(self, trajectory: OpenTrajectory, reason: str) -> None:
        identity = self._identity(trajectory.key)
        key = trajectory.key
        if reason == "done" and self._inference is not None and _mapped_id(key):
            assert key.trajectory_id is not None
            self._inference.forget_mapped(key.project, key.trajectory_id)
        if identity is not None:
            self._parts[identity] = trajectory.part
            while len(self._parts) > self._max_open:
                self._parts.popitem(last=False)
        self._finish_later(trajectory, reason)

    def _finish(self, trajectory: OpenTrajectory, reason: str) -> None:
        self._closing.pop(trajectory.id, None)
        if not trajectory.calls and not trajectory.tools and not trajectory.dropped:
            # Nothing forwarded in it (a reward alone): no record; the reward still counts.
            key = trajectory.key
            if self._gate is not None:
                for outcome in trajectory.outcomes:
                    self._gate.annotate(outcome, key.project, key.experiment)
            return
        notes = self._key_notes(trajectory.key) if self._key_notes is not None else None
        built = build_trajectory(trajectory, reason, notes)
        self._ledger.hold(built, trajectory.units)
        if self._gate is not None:
            self._gate.release(built)
        else:
            self._emit(built)
        if self._on_close is not None:
            self._on_close(reason)
