"""How well the records reconstruct the truth: grouping, tools, resumes, steps, groups.

Units are HTTP requests, identified by the server's response id (truth.py). A recorded
trajectory is its key's identity, so the parts of one trajectory (`part` 2, 3...: calls that
came after it was closed) count as one recorded trajectory; how many true trajectories were
split into parts is reported on its own.

- grouping: pairwise over requests, "same true trajectory" vs "same recorded trajectory":
  precision = right pairs / recorded pairs, recall = right pairs / true pairs;
- exact: a true trajectory whose requests are exactly one recorded trajectory's;
- tool spans: matched as a multiset on (true trajectory, name, canonical arguments, result);
  unparsed spans never match;
- parallel: turns with 2+ tool calls whose recorded spans are exactly the true ones;
- tool errors: true "Error when executing tool" results recorded with `error.type == "tool_error"`;
- resumes: the recorded call of an interrupted generate lists every HTTP call in `segments`
  and has the concatenated output ids and the final finish reason;
- steps/validation: with headers, the key's values; without, each true phase (step,
  validation) must map to one inferred step of its own (per proxy);
- groups: with headers, sample_index and rollout_n; without, pairwise over trajectories,
  "same GRPO group" vs "same (inferred step, sample_hash)", and distinct rollout_n per group.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from groundtruth.tooling import canonical
from groundtruth.truth import TrueTool, TrueTrajectory, Truth

Record = dict[str, Any]


@dataclass
class Ratio:
    hit: int = 0
    total: int = 0

    @property
    def value(self) -> float:
        return self.hit / self.total if self.total else 1.0

    def add(self, ok: bool) -> None:
        self.hit += int(ok)
        self.total += 1

    def __str__(self) -> str:
        return f"{self.value:.4f} ({self.hit}/{self.total})"


@dataclass
class PR:
    """Precision and recall from counts of right, recorded and true items."""

    right: int = 0
    recorded: int = 0
    true: int = 0

    @property
    def precision(self) -> float:
        return self.right / self.recorded if self.recorded else 1.0

    @property
    def recall(self) -> float:
        return self.right / self.true if self.true else 1.0

    def __str__(self) -> str:
        return f"P {self.precision:.4f} R {self.recall:.4f}"


@dataclass
class VariantScore:
    trajectories: int = 0
    grouping: PR = field(default_factory=PR)
    exact: Ratio = field(default_factory=Ratio)
    tools: PR = field(default_factory=PR)


@dataclass
class Score:
    with_headers: bool
    variants: dict[str, VariantScore]
    grouping: PR
    exact: Ratio
    tools: PR
    parallel: Ratio
    tool_errors: PR
    resumes: Ratio
    false_merges: int
    steps: Ratio
    steps_separated: bool
    validation: Ratio
    groups: PR
    rollout_n: Ratio
    split_trajectories: int
    missing_requests: int
    ambiguous_groups: int
    records: int


# --- the recorded side --------------------------------------------------------------------------


@dataclass
class RecordedCall:
    record: Record
    position: int
    cluster: Hashable
    request_ids: list[str]


def cluster_of(record: Record) -> Hashable:
    """A recorded trajectory's identity, the same for all of its parts."""
    key = record["key"]
    where = tuple(record.get("upstreams") or ())
    if key.get("trajectory_id") is not None:
        return (where, key["project"], "id", key["trajectory_id"])
    if key.get("sample_index") is not None:
        fields = ("experiment", "step", "validate", "sample_index", "rollout_n")
        return (where, key["project"], "key", *(key.get(f) for f in fields))
    return (where, "record", record["id"])


def call_request_ids(call: Record) -> list[str]:
    segments = call.get("segments")
    if segments:
        return [str(s.get("request_id")) for s in segments]
    return [str(call.get("request_id"))]


class Recorded:
    """The records, indexed by request id and by recorded trajectory."""

    def __init__(self, records: Sequence[Record]) -> None:
        self.records = records
        self.by_request: dict[str, RecordedCall] = {}
        self.clusters: dict[Hashable, list[str]] = defaultdict(list)
        self.keys: dict[Hashable, dict[str, Any]] = {}
        self.units: dict[int, list[str]] = {}  # by id() of a recorded call: its request ids
        # A batch's calls share the response id: each is its id and its reply (see truth.py).
        seen = Counter(rid for record in records for c in record["calls"]
                       for rid in call_request_ids(c))  # fmt: skip
        for record in sorted(records, key=lambda r: r.get("part", 1)):
            cluster = cluster_of(record)
            self.keys.setdefault(cluster, record["key"])
            for position, call in enumerate(record["calls"]):
                ids = call_request_ids(call)
                if len(ids) == 1 and seen[ids[0]] > 1:
                    outputs = call.get("outputs") or [{}]
                    ids = [f"{ids[0]}#{outputs[0].get('text')}"]
                self.units[id(call)] = ids
                rc = RecordedCall(record, position, cluster, ids)
                for rid in ids:
                    self.by_request[rid] = rc
                    self.clusters[cluster].append(rid)

    def cluster(self, request_id: str) -> Hashable:
        found = self.by_request.get(request_id)
        return found.cluster if found is not None else ("missing", request_id)


# --- scoring ------------------------------------------------------------------------------------


def score(truth: Truth, records: Sequence[Record], with_headers: bool) -> Score:
    """Every measure of the module docstring; steps and groups are judged by the key's values
    with headers, and by how they partition the truth without."""
    recorded = Recorded(records)
    trajectories = truth.trajectories
    variants = {t.variant: VariantScore() for t in trajectories}
    for t in trajectories:
        variants[t.variant].trajectories += 1
    grouping = _grouping(truth, recorded, variants)
    exact = _exact(trajectories, recorded, variants)
    tools, parallel, errors = _tools(truth, recorded, variants)
    resumes, false_merges = _resumes(truth, recorded)
    if with_headers:
        steps, validation, separated = _header_steps(trajectories, recorded)
        groups, rollout_n = _header_groups(trajectories, recorded)
    else:
        steps, separated = _inferred_steps(trajectories, recorded)
        validation = Ratio()
        groups, rollout_n = _inferred_groups(trajectories, recorded)
    return Score(
        with_headers=with_headers,
        variants=variants,
        grouping=grouping,
        exact=exact,
        tools=tools,
        parallel=parallel,
        tool_errors=errors,
        resumes=resumes,
        false_merges=false_merges,
        steps=steps,
        steps_separated=separated,
        validation=validation,
        groups=groups,
        rollout_n=rollout_n,
        split_trajectories=_split(trajectories, recorded),
        missing_requests=sum(
            1 for t in trajectories for r in t.request_ids if r not in recorded.by_request
        ),
        ambiguous_groups=_ambiguous(trajectories),
        records=len(records),
    )


def _pairs(items: Iterable[str]) -> Iterable[tuple[str, str]]:
    return combinations(sorted(set(items)), 2)


def _grouping(truth: Truth, recorded: Recorded, variants: dict[str, VariantScore]) -> PR:
    owner = {rid: t for t in truth.trajectories for rid in t.request_ids}
    total = PR()
    for t in truth.trajectories:
        count = len(t.request_ids) * (len(t.request_ids) - 1) // 2
        variants[t.variant].grouping.true += count
        total.true += count
    for members in recorded.clusters.values():
        for a, b in _pairs(members):
            ta, tb = owner.get(a), owner.get(b)
            right = ta is not None and ta is tb
            total.recorded += 1
            total.right += int(right)
            for name in {x.variant for x in (ta, tb) if x is not None}:
                variants[name].grouping.recorded += 1
                variants[name].grouping.right += int(right)
    return total


def _exact(
    trajectories: list[TrueTrajectory], recorded: Recorded, variants: dict[str, VariantScore]
) -> Ratio:
    total = Ratio()
    for t in trajectories:
        cluster = recorded.cluster(t.request_ids[0])
        ok = sorted(recorded.clusters.get(cluster, [])) == sorted(t.request_ids)
        total.add(ok)
        variants[t.variant].exact.add(ok)
    return total


def _tool_key(t: TrueTrajectory, name: Any, arguments: Any, result: Any) -> tuple[Any, ...]:
    return (t.id, name, _canonical(arguments), result)


def _recorded_spans(
    truth: Truth, recorded: Recorded
) -> list[tuple[TrueTrajectory | None, dict[str, Any]]]:
    """Every recorded span, with the true trajectory of the call that asked for it."""
    owner = truth.by_request()
    spans = []
    for record in recorded.records:
        for span in record.get("tools") or []:
            by = span.get("requested_by")
            calls = record["calls"]
            t = None
            if isinstance(by, int) and 0 <= by < len(calls):
                found = owner.get(recorded.units[id(calls[by])][0])
                t = found[0] if found else None
            spans.append((t, span))
    return spans


Pool = dict[tuple[Any, ...], list[dict[str, Any]]]


def _tools(
    truth: Truth, recorded: Recorded, variants: dict[str, VariantScore]
) -> tuple[PR, Ratio, PR]:
    """Tool spans matched as a multiset; also the parallel-turn and tool-error scores."""
    total = PR()
    pool = _span_pool(truth, recorded, variants, total)
    matched: dict[int, dict[str, Any] | None] = {}
    for t in truth.trajectories:
        for tool in t.tools:
            found = _take(pool, _tool_key(t, tool.name, tool.arguments, tool.result))
            matched[id(tool)] = found
            for pr in (total, variants[t.variant].tools):
                pr.true += 1
                pr.right += found is not None
    return total, _parallel(truth, recorded), _errors(truth, recorded, matched)


def _span_pool(
    truth: Truth, recorded: Recorded, variants: dict[str, VariantScore], total: PR
) -> Pool:
    """Recorded spans by match key, counted as recorded (unparsed ones never match)."""
    pool: Pool = defaultdict(list)
    for t, span in _recorded_spans(truth, recorded):
        total.recorded += 1
        if t is None:
            continue
        variants[t.variant].tools.recorded += 1
        if span.get("raw") is None:
            key = _tool_key(t, span.get("name"), span.get("arguments"), span.get("result"))
            pool[key].append(span)
    return pool


def _take(pool: Pool, key: tuple[Any, ...]) -> dict[str, Any] | None:
    found = pool.get(key)
    return found.pop() if found else None


def _parallel(truth: Truth, recorded: Recorded) -> Ratio:
    """Turns with parallel calls: the recorded call of that turn has exactly its spans."""
    ratio = Ratio()
    for t in truth.trajectories:
        turns: dict[int, list[TrueTool]] = defaultdict(list)
        for tool in t.tools:
            turns[tool.requested_by].append(tool)
        for turn, tools in turns.items():
            if len(tools) < 2:
                continue
            found = recorded.by_request.get(t.calls[turn].request_ids[0])
            spans = [] if found is None else found.record.get("tools") or []
            got = Counter(
                (s.get("name"), _canonical(s.get("arguments")), s.get("result"))
                for s in spans
                if found is not None and s.get("requested_by") == found.position
            )
            ratio.add(got == Counter((x.name, x.arguments, x.result) for x in tools))
    return ratio


def _canonical(arguments: Any) -> Any:
    return canonical(arguments) if isinstance(arguments, str) else arguments


def _errors(truth: Truth, recorded: Recorded, matched: dict[int, dict[str, Any] | None]) -> PR:
    flagged = sum(
        1
        for record in recorded.records
        for span in record.get("tools") or []
        if (span.get("error") or {}).get("type") == "tool_error"
    )
    pr = PR(recorded=flagged)
    for t in truth.trajectories:
        for tool in t.tools:
            span = matched.get(id(tool))
            flagged_right = (
                span is not None and (span.get("error") or {}).get("type") == "tool_error"
            )
            if tool.error:
                pr.true += 1
                pr.right += int(flagged_right)
    return pr


def _resumes(truth: Truth, recorded: Recorded) -> tuple[Ratio, int]:
    ratio = Ratio()
    for t in truth.trajectories:
        for call in t.calls:
            if len(call.request_ids) < 2:
                continue
            found = recorded.by_request.get(call.request_ids[0])
            ok = False
            if found is not None:
                rc = found.record["calls"][found.position]
                output = (rc.get("outputs") or [{}])[0]
                ok = (
                    found.request_ids == call.request_ids
                    and output.get("token_ids") == call.output_ids
                    and output.get("finish_reason") == call.finish_reason
                )
            ratio.add(ok)
    owner = truth.by_request()
    false_merges = sum(
        1
        for record in recorded.records
        for call in record["calls"]
        if len({owner[r][0].id + f"/{owner[r][1]}" for r in recorded.units[id(call)] if r in owner})
        > 1
    )
    return ratio, false_merges


def _key_of(t: TrueTrajectory, recorded: Recorded) -> dict[str, Any]:
    return recorded.keys.get(recorded.cluster(t.request_ids[0]), {})


def _header_steps(
    trajectories: list[TrueTrajectory], recorded: Recorded
) -> tuple[Ratio, Ratio, bool]:
    steps, validation = Ratio(), Ratio()
    for t in trajectories:
        key = _key_of(t, recorded)
        steps.add(key.get("step") == t.step)
        validation.add(bool(key.get("validate")) == t.validate)
    return steps, validation, steps.hit == steps.total


def _inferred_steps(trajectories: list[TrueTrajectory], recorded: Recorded) -> tuple[Ratio, bool]:
    """Each true phase gets the inferred step most of its trajectories got; right when a
    trajectory has its phase's step and no two phases of one proxy share a step."""
    seen: dict[tuple[str, int, bool], Counter[Any]] = defaultdict(Counter)
    for t in trajectories:
        seen[(t.backend, t.step, t.validate)][_key_of(t, recorded).get("step")] += 1
    majority = {phase: counts.most_common(1)[0][0] for phase, counts in seen.items()}
    by_backend: dict[str, list[Any]] = defaultdict(list)
    for (backend, _, _), step in majority.items():
        by_backend[backend].append(step)
    separated = all(None not in s and len(set(s)) == len(s) for s in by_backend.values())
    ratio = Ratio()
    for t in trajectories:
        ratio.add(_key_of(t, recorded).get("step") == majority[(t.backend, t.step, t.validate)])
    return ratio, separated


def _header_groups(trajectories: list[TrueTrajectory], recorded: Recorded) -> tuple[PR, Ratio]:
    exact = Ratio()
    for t in trajectories:
        key = _key_of(t, recorded)
        exact.add((key.get("sample_index"), key.get("rollout_n")) == (t.sample_index, t.rollout_n))
    return PR(exact.hit, exact.total, exact.total), exact


def _inferred_groups(trajectories: list[TrueTrajectory], recorded: Recorded) -> tuple[PR, Ratio]:
    inferred: dict[Hashable, list[TrueTrajectory]] = defaultdict(list)
    true_groups: dict[str, list[TrueTrajectory]] = defaultdict(list)
    for t in trajectories:
        key = _key_of(t, recorded)
        inferred[(t.backend, key.get("step"), key.get("sample_hash"))].append(t)
        true_groups[t.group].append(t)
    pr = PR()
    for members in true_groups.values():
        pr.true += len(members) * (len(members) - 1) // 2
    for members in inferred.values():
        for a, b in combinations(members, 2):
            pr.recorded += 1
            pr.right += int(a.group == b.group)
    rollout_n = Ratio()
    for members in true_groups.values():
        numbers = [_key_of(t, recorded).get("rollout_n") for t in members]
        rollout_n.add(
            sorted(n if isinstance(n, int) else -1 for n in numbers) == list(range(len(members)))
        )
    return pr, rollout_n


def _split(trajectories: list[TrueTrajectory], recorded: Recorded) -> int:
    """True trajectories whose calls landed in more than one record (parts)."""
    count = 0
    for t in trajectories:
        records = {
            id(recorded.by_request[r].record) for r in t.request_ids if r in recorded.by_request
        }
        count += len(records) > 1
    return count


def _ambiguous(trajectories: list[TrueTrajectory]) -> int:
    """GRPO groups where two rollouts gave the same first answer: not recoverable from traffic."""
    groups: dict[str, list[str]] = defaultdict(list)
    for t in trajectories:
        groups[t.group].append(t.first_reply)
    return sum(1 for replies in groups.values() if len(set(replies)) < len(replies))


# --- the report ---------------------------------------------------------------------------------


def format_report(score: Score) -> str:
    mode = "with headers" if score.with_headers else "without metadata"
    count = sum(v.trajectories for v in score.variants.values())
    lines = [
        f"### trace-proxy ground truth, {mode}: {count} trajectories, {score.records} records",
        "",
        "| variant | trajectories | grouping P | grouping R | exact | tools P | tools R |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in sorted(score.variants.items()):
        lines.append(
            f"| {name} | {v.trajectories} | {v.grouping.precision:.4f} | {v.grouping.recall:.4f} "
            f"| {v.exact.value:.4f} | {v.tools.precision:.4f} | {v.tools.recall:.4f} |"
        )
    lines.append(
        f"| **all** | {count} "
        f"| {score.grouping.precision:.4f} | {score.grouping.recall:.4f} | {score.exact.value:.4f} "
        f"| {score.tools.precision:.4f} | {score.tools.recall:.4f} |"
    )
    lines += [
        "",
        f"- parallel tool-call turns right: {score.parallel}",
        f"- tool errors flagged: {score.tool_errors} (right {score.tool_errors.right}, "
        f"flagged {score.tool_errors.recorded}, true {score.tool_errors.true})",
        f"- resumed generates merged right: {score.resumes}; calls merging different generates: "
        f"{score.false_merges}",
        f"- steps right: {score.steps}; phases separated: {score.steps_separated}"
        + ("" if not score.with_headers else f"; validation right: {score.validation}"),
        f"- groups: {score.groups}; rollout_n right: {score.rollout_n}",
        f"- true trajectories split over several records (parts): {score.split_trajectories}; "
        f"requests never recorded: {score.missing_requests}; groups with identical rollouts: "
        f"{score.ambiguous_groups}",
    ]
    return "\n".join(lines)
