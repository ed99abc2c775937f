"""Sending recorded calls again, through a proxy of our own, so the answers become a new run.

A replay does not record anything itself: it starts the same proxy `trace-proxy serve` runs
(in this process, capture and export inline) in front of the given server, and sends each
call to it with the key a trajectory of the new run is recorded under (`baggage`: the original
project, the new experiment, the original step, sample, rollout and validate flag, the
original record's id as trajectory id). Once a trajectory's calls are answered, its
`replay_of` labels are posted with `done`, so it closes at once and says what it replays.

Trajectories go step by step, at most `concurrency` at a time; a trajectory's calls go one
after another, in their recorded order, each with its recorded inputs ("same inputs": the new
server's answers to the exact contexts the recorded one saw, not a new rollout). Headers the
user gives are sent with every call and never written anywhere by the replay (the proxy records
request headers as it always does: credentials, by their names, as `[redacted]`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from trace_proxy.config import Settings
from trace_proxy.proxy.service import ProxyService
from trace_proxy.replay.requests import NotReplayable, ReplayCall, replay_calls
from trace_proxy.replay.selection import (
    RecordedRun,
    ReplayError,
    recorded_runs,
    trajectory_records,
)

log = logging.getLogger(__name__)
MAX_REASON = 200  # characters of an answer kept as a failure's reason


@dataclass
class ReplayPlan:
    """What to send where, and under which names the answers are recorded."""

    upstream: str
    output: Path
    experiment: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 16
    token2text: bool = False
    tokenizer: list[str] = field(default_factory=list)


@dataclass
class Failure:
    """A recorded call that failed when sent again, or could not be sent, and why."""

    trajectory: str  # the original record's id
    call: int
    reason: str


@dataclass
class ReplayReport:
    """What a replay did: the summary the command line prints."""

    project: str
    experiment: str
    output: Path
    sent: int = 0
    failed: list[Failure] = field(default_factory=list)
    skipped: list[Failure] = field(default_factory=list)
    trajectories: int = 0  # replayed trajectories the store holds now
    directory: Path | None = None  # the new run's directory
    token_ids_missing: int = 0  # replayed calls without the token ids their recorded one had
    left_in_spool: Path | None = None  # records not written, kept where they wait


async def check_reachable(upstream: str, headers: dict[str, str]) -> None:
    """Any HTTP answer from the server will do (404 included); raises ReplayError when none
    comes."""
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(upstream.rstrip("/") + "/health", headers=headers) as answer:
                await answer.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ReplayError(f"cannot reach the upstream {upstream}: {_reason(exc)}") from None


async def replay(
    run: RecordedRun, trajectories: Sequence[dict[str, Any]], plan: ReplayPlan
) -> ReplayReport:
    """Send every call of `trajectories` (records of `run`) through a proxy of our own to
    `plan.upstream`; the answers are recorded as `plan.experiment` of the same project."""
    await check_reachable(plan.upstream, plan.headers)
    report = ReplayReport(run.project, plan.experiment, plan.output)
    spool = Path(tempfile.mkdtemp(prefix="trace-proxy-replay-"))
    settings = dataclasses.replace(
        Settings(),
        upstream=[plan.upstream],
        port=0,
        admin_port=0,
        output=plan.output,
        spool_dir=spool,  # its own: a proxy still writing this store keeps its spool
        project=run.project,
        experiment=plan.experiment,
        capture_mode="inline",
        export_mode="inline",
        token2text=plan.token2text,
        tokenizer=list(plan.tokenizer),
        read_timeout=None,
    )
    service = ProxyService(settings)
    try:
        addresses = await service.start()
        await service.wait_ready()
        assert addresses.admin is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            sender = _Sender(http, addresses.proxy, addresses.admin, run, plan, report)
            for step in _by_step(trajectories):
                await sender.trajectories(step)
    finally:
        await service.stop()
        if service.backlog and any(service.backlog.values()):
            report.left_in_spool = spool  # records not written yet: kept, and said where
        else:
            shutil.rmtree(spool, ignore_errors=True)
    _read_back(report, trajectories)
    return report


def _read_back(report: ReplayReport, recorded: Sequence[dict[str, Any]]) -> None:
    """What the new run holds: its replayed trajectories, its directory, and how many of their
    calls came back without the token ids the recorded call had (its request asked for them
    with a field the record does not keep, `return_token_ids`)."""
    try:
        found = recorded_runs(report.output)
    except ReplayError:  # nothing written at all
        return
    originals = {record.get("id"): record for record in recorded}
    for run in found:
        if (run.project, run.experiment) != (report.project, report.experiment):
            continue
        report.directory = run.directories[0]
        for replayed in trajectory_records(run):
            original = originals.get((replayed.get("labels") or {}).get("replay_of"))
            if original is None:
                continue
            report.trajectories += 1
            calls, again = original.get("calls") or [], replayed.get("calls") or []
            if len(calls) == len(again):  # call for call (none left out as not replayable)
                report.token_ids_missing += sum(
                    _has_token_ids(old) and not _has_token_ids(new)
                    for old, new in zip(calls, again, strict=True)
                )


def _has_token_ids(call: Any) -> bool:
    outputs = call.get("outputs") if isinstance(call, dict) else None
    first = outputs[0] if isinstance(outputs, list) and outputs else None
    return isinstance(first, dict) and bool(first.get("token_ids"))


def _by_step(trajectories: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Trajectories grouped by step, in step order: a step ends before the next starts, as
    it did when recorded, so none closes late."""
    steps: dict[tuple[bool, int], list[dict[str, Any]]] = {}
    for record in trajectories:
        key = record.get("key") or {}
        step = key.get("step")
        order = (bool(key.get("validate")), step if isinstance(step, int) else -1)
        steps.setdefault(order, []).append(record)
    return [steps[order] for order in sorted(steps, key=lambda o: (o[1], o[0]))]


class _Sender:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        proxy: str,
        admin: str,
        run: RecordedRun,
        plan: ReplayPlan,
        report: ReplayReport,
    ) -> None:
        self.http, self.proxy, self.admin = http, proxy, admin
        self.run, self.plan, self.report = run, plan, report
        self.slots = asyncio.Semaphore(max(1, plan.concurrency))

    async def trajectories(self, records: Sequence[dict[str, Any]]) -> None:
        await asyncio.gather(*(self.trajectory(record) for record in records))

    async def trajectory(self, record: dict[str, Any]) -> None:
        original = str(record.get("id"))
        async with self.slots:
            headers = {**self.plan.headers, "baggage": self._baggage(record)}
            sent = False
            try:
                for call in replay_calls(record, self.plan.model, self.plan.extra):
                    if isinstance(call, NotReplayable):
                        self.report.skipped.append(Failure(original, call.index, call.reason))
                        continue
                    sent = True
                    await self._send(original, call, headers)
            finally:  # interrupted too: what was recorded of it still says what it replays
                if sent:
                    await self._close(record)

    def _baggage(self, record: dict[str, Any]) -> str:
        key = record.get("key") or {}
        fields = {
            "project": self.run.project,
            "experiment": self.plan.experiment,
            "trajectory_id": str(record.get("id")),
            "step": key.get("step"),
            "sample_index": key.get("sample_index"),
            "n": key.get("rollout_n"),
            "validate": "true" if key.get("validate") else None,
        }
        return ",".join(
            f"rollout.{name}={quote(str(value), safe='')}"
            for name, value in fields.items()
            if value is not None
        )

    async def _send(self, original: str, call: ReplayCall, headers: dict[str, str]) -> None:
        body = orjson.dumps(call.body)
        sending = {**headers, "Content-Type": "application/json"}
        try:
            async with self.http.post(self.proxy + call.path, data=body, headers=sending) as answer:
                data = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.report.failed.append(Failure(original, call.index, _reason(exc)))
            return
        self.report.sent += 1
        if status >= 400:
            text = data[:MAX_REASON].decode("utf-8", "replace")
            self.report.failed.append(Failure(original, call.index, f"HTTP {status}: {text}"))

    async def _close(self, record: dict[str, Any]) -> None:
        """The replayed trajectory's labels, and its end: it closes now."""
        labels = {
            "replay_of": str(record.get("id")),
            "replay_of_project": self.run.project,
            "replay_of_experiment": self.run.experiment,
        }
        if self.plan.model is not None:
            labels["replay_model"] = self.plan.model
        body = {
            "trajectory_id": str(record.get("id")),
            "project": self.run.project,
            "experiment": self.plan.experiment,
            "labels": labels,
            "done": True,
        }
        async with self.http.post(self.admin + "/rewards", json=body) as answer:
            if answer.status >= 400:  # our own proxy refusing our own labels: a bug
                text = (await answer.read())[:MAX_REASON].decode("utf-8", "replace")
                log.error("the replay's labels were refused: HTTP %s: %s", answer.status, text)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:MAX_REASON]
