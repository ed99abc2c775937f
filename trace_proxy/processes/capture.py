"""The capture process: parsing, assembling, sampling and spooling run beside the forwarder.

Parsing a 32k-token exchange takes milliseconds of JSON decoding; in the forwarding process
every request waiting behind it would wait too. Here the forwarder only writes each finished
exchange, as raw bytes, to a socket (`wire.py`); a child process runs the `Recorder` (capture
stage, assembler, gate, spool, and the export process under it) and sends back its metrics,
its open-trajectory count, reward answers and flush answers.

Refused samples: the sampler's refusals are final (a sample it drops stays dropped for its
step), so the child names each refused sample once (`refused`) and the forwarder, which
resolves the same key hints from the same headers, sends the later calls of that sample as
heads without bodies (`exchange.REFUSED` marks): the child counts them as before, and with
10 samples of 1,000 kept, the bodies of nearly every call no longer cross the socket. A rate
(or keeping no sample) needs no state: the forwarder applies it itself, from the first call.

Backpressure: the child reads only while its own queue has room, so a backlog stays in the
forwarder's socket buffer, which is bounded: past half of `--capture-queue-bytes` new
exchanges are dropped and counted (`capture_queue_bytes`); the child's queue holds the other
half. If the child dies, another starts; what the dead one held (in transit, queued, in open
trajectories or not yet spooled) is lost and counted exactly, once the new one has opened the
spool (`capture_process_lost`, logged; see `ledger.py`). The new one is told so first
(`restarted`): the trajectories it opens may have begun in the dead one, and say so
(`assembler.follow_restart`), for readers to join with what that one wrote.

Start-up: the forwarder writes to the socket from the moment the child is spawned; the child
reads once it is up (a second or so), and says `ready` before its spool and its export process
are: those report through its `status` (`checks`, for /ready). A configuration error found
after that (a tokenizer, a backend, a spool held by another proxy) comes as `fatal`.

Messages to the child are frames (`wire.py`): exchanges, and control messages `restarted`,
`sampling`, `annotate`, `flush`, `hurry` (shutdown has begun), `stop`. From it, JSON lines:
`ready` or `error`, `status` (metrics text, open trajectories, its ledger and how far the
spool is written, readiness checks, and at the end the spool's backlog), `spooling` (what a
batch about to be written carries), `fatal`, `discovered`, `annotated`, `flushed`, `stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import sys
import time
from collections import OrderedDict
from typing import Any

import orjson
from prometheus_client import generate_latest

from trace_proxy.capture.exchange import MARKS_BYTES, REFUSED, Exchange, dropped_mark
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.routes import RouteKind, classify
from trace_proxy.capture.wire import FrameReader, LongFrame, encode_control, encode_exchange
from trace_proxy.config import ConfigError, Settings
from trace_proxy.metrics import Metrics, RelayedMetrics
from trace_proxy.processes.helper import Helper, Started, receive_payload, run_helper
from trace_proxy.processes.lifeline import Lifeline
from trace_proxy.processes.recorder import Recorder
from trace_proxy.text.token2text import TokenizerError
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.ledger import Custody, Unsettled
from trace_proxy.trajectories.rewards import RewardError
from trace_proxy.trajectories.sampler import (
    DECIDED_STEPS,
    StepDecision,
    parse_decision,
    sampler_of,
)

log = logging.getLogger(__name__)

STATUS_EVERY = 1.0
RESTART_DELAY = 1.0
SOCKET_BUFFER = 4 << 20  # the kernel's share of the backlog (at most a quarter of ours)
REFUSED_SAMPLES = 1 << 16  # refused samples remembered (each side), the latest named kept


class CaptureProcess(Helper):
    """The forwarder's side: starts, feeds, supervises and stops the capture process."""

    name = "capture process"
    restart_delay = RESTART_DELAY

    def __init__(self, settings: Settings, metrics: Metrics, resolver: MetadataResolver) -> None:
        """`resolver`: the forwarder's, for telling a refused sample's calls apart."""
        self._max_buffered = settings.capture_queue_bytes // 2
        super().__init__(
            __name__, settings, buffer_bytes=min(SOCKET_BUFFER, self._max_buffered // 4)
        )
        self.settings = settings
        self._metrics = metrics
        self._relayed = RelayedMetrics()
        metrics.registry.register(self._relayed)
        self._backends = list(dict.fromkeys(settings.backend))
        self._custody = Custody()  # what the current child was sent, and where it is
        self.bodies_sent = 0  # exchanges sent whole (a refused sample's calls go as heads)
        self._unsettled: Unsettled | None = None  # a dead child's, until the spool is opened
        self.open_count = 0
        self.generation = 0  # capture processes started so far
        self._since = time.time()  # before any call: the earliest start a record of ours has
        self._ids = itertools.count()
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._transport: asyncio.WriteTransport | None = None
        # Frames of this loop iteration's exchanges, written together by `_write_pending`.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._resolver = resolver
        self._refused: OrderedDict[tuple[Any, ...], None] = OrderedDict()  # as the child said
        # Steps decided by whoever saw their batch (`give_samples`), told again to a new child.
        self._decisions: OrderedDict[tuple[str, int, bool], StepDecision] = OrderedDict()
        self._sampler = sampler_of(settings)  # for the refusals that need no state alone
        self._refuses_alone = self._sampler.refuses_alone
        self._child_checks: dict[str, str] = {}  # as the child last said
        self.backlog: dict[str, int] | None = None  # per backend, as the child said at its end

    @property
    def backends(self) -> list[str]:
        return self._backends

    def admit(self, exchange: Exchange) -> bool:
        """Every exchange goes to the child, which asks the sampler before parsing."""
        return True

    def submit(self, exchange: Exchange) -> None:
        """On the hot path: queue the exchange's frames; never blocks, never raises."""
        transport = self._transport
        if transport is None or transport.is_closing():
            self._metrics.capture_dropped.labels("capture_process_down").inc()
            return
        buffered = transport.get_write_buffer_size() + self._pending_bytes
        if (self._refused or self._refuses_alone) and self._refuses(exchange):
            if buffered < self._max_buffered + MARKS_BYTES:
                self._queue(encode_exchange(dropped_mark(exchange, REFUSED)))
                self._custody.sent += 1  # settled by the child as it counts the refusal
            else:  # counted where the child would have counted it
                self._metrics.capture_dropped.labels("sampler").inc()
            return
        size = len(exchange.request_body) + sum(map(len, exchange.response_chunks))
        if buffered and buffered + size > self._max_buffered:
            self._metrics.capture_dropped.labels("capture_queue_bytes").inc()
            if buffered < self._max_buffered + MARKS_BYTES:
                self._queue(encode_exchange(dropped_mark(exchange, "capture_queue_bytes")))
            return
        self._queue(encode_exchange(exchange))
        self._custody.sent += 1
        self.bodies_sent += 1

    def _refuses(self, exchange: Exchange) -> bool:
        """A generate call of a sample the sampler refuses: as the child said, or by a
        policy that needs no state (a rate, or no sample kept)."""
        if classify(exchange.method, exchange.path) is not RouteKind.GENERATE:
            return False
        hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, None)
        sample = hints.sample()
        if sample is None:
            return False
        if sample in self._refused:
            return True
        _, experiment, step, validate, index = sample
        experiment = self.settings.experiment if experiment is None else experiment
        return self._sampler.refused(experiment, step, bool(validate), index)

    def _queue(self, frames: list[bytes]) -> None:
        """One write per loop iteration, not one per exchange: at 64 requests in flight a
        socket write (and a wake-up of the child) per exchange was a sixth of the
        forwarder's time."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._write_pending)
        self._pending.extend(frames)
        self._pending_bytes += sum(map(len, frames))

    def _write_pending(self) -> None:
        """Also called before any control message, so that one follows the exchanges
        submitted before it."""
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        transport = self._transport
        if pending and transport is not None and not transport.is_closing():
            transport.writelines(pending)  # else counted lost with the child (`_died`)

    async def flush(self) -> None:
        await self._ask({"op": "flush"})

    async def annotate(self, payload: Any) -> str:
        where: str = await self._ask({"op": "annotate", "outcome": payload})
        return where

    async def give_samples(self, decision: StepDecision) -> bool:
        """Told to this capture process, and to the next one if it is restarted."""
        key = (decision.experiment, decision.step, decision.validate)
        known = self._decisions.pop(key, None)
        if known is not None:  # a step given in parts: all of it for the next process
            decision = StepDecision(*key, tuple(dict.fromkeys((*known.kept, *decision.kept))))
        self._decisions[key] = decision
        while len(self._decisions) > DECIDED_STEPS:
            self._decisions.popitem(last=False)
        given: bool = await self._ask({"op": "sampling", "decision": decision.as_json()})
        return given

    def checks(self) -> dict[str, str]:
        """For /ready: this process's state, and what it last said of its spool, its export
        process and the tokenizers."""
        checks = {"capture": self.check}
        if self._unsettled is not None:  # from the death until the next one opens the spool
            checks["capture"] = "restarted: waiting for the new process to open the spool"
        if self.ready and self._child_checks:
            checks.update(self._child_checks)
        else:
            checks["export"] = checks["spool"] = "waiting for the capture process"
            if self.settings.uses_tokenizers:
                checks["tokenizer"] = "waiting for the capture process"
        return checks

    def hurry(self) -> None:
        """Shutdown has begun: the export process may use more CPU to drain the spool."""
        writer = self._writer
        if self._transport is not None and writer is not None and not writer.is_closing():
            self._write_pending()
            writer.write(encode_control({"op": "hurry"}))

    async def stop(self, timeout: float) -> None:
        """After the listener stopped: the child parses what it has, closes every trajectory
        and exports (within `timeout`), then leaves."""
        self._write_pending()
        await self._stop(encode_control({"op": "stop", "timeout": timeout}), timeout + 60)
        self._transport = None
        self._fail_answers("the capture process has stopped")
        if self._unsettled is not None:  # no child opened the spool since one died
            self._count_lost(self._unsettled.lost(None), exact=False)
            self._unsettled = None

    def _connected(self) -> None:
        """From now on exchanges go to this child; they wait in the socket until it is up."""
        assert self._writer is not None
        self._custody = Custody()
        self._refused.clear()  # a new sampler: it says again what it refuses
        self._child_checks = {}
        self._transport = self._writer.transport  # type: ignore[assignment]
        if self.generation:  # ahead of any exchange: its trajectories may have begun before
            self._writer.write(encode_control({"op": "restarted", "since": self._since}))
        for (
            decision
        ) in self._decisions.values():  # what the last one was told, ahead of any exchange
            self._writer.write(encode_control({"op": "sampling", "decision": decision.as_json()}))
        self.generation += 1

    def _died(self) -> None:
        self._relayed.retire()
        self._transport = None
        self._pending, self._pending_bytes = [], 0
        if self._unsettled is not None:  # two deaths before a child opened the spool
            self._count_lost(self._unsettled.lost(None), exact=False)
        # Counted once the next child says where the spool ends (what was written is not lost).
        self._unsettled = self._custody.unsettled()
        self._metrics.capture_process_restarts.inc()
        self._fail_answers("the capture process ended unexpectedly")
        self.open_count = 0

    def _count_lost(self, lost: int, exact: bool) -> None:
        self._metrics.capture_dropped.labels("capture_process_lost").inc(lost)
        if lost:
            log.error("%d calls (in transit, queued, in open trajectories or not yet spooled) "
                      "were lost with the capture process%s", lost,
                      "" if exact else " (at most: the spool was not opened again)")  # fmt: skip

    def _on_message(self, op: str, message: dict[str, Any]) -> None:
        if op == "status":
            self._relayed.text = message["metrics"]
            self.open_count = message["open"]
            self._custody.update(message["ledger"])
            if message["spooled_through"] is not None:
                self._custody.written(message["spooled_through"])
            if self._unsettled is not None and message["spool_from"] is not None:
                self._count_lost(self._unsettled.lost(message["spool_from"]), exact=True)
                self._unsettled = None
            self.backlog = message.get("backlog", self.backlog)
            if message["checks"] != self._child_checks:
                self._child_checks = message["checks"]
                if self.on_change is not None:
                    self.on_change()
        elif op == "fatal":
            kind = TokenizerError if message.get("kind") == "tokenizer" else ConfigError
            self._fail(kind(message["message"]))
        elif op == "spooling":
            self._custody.update(message["ledger"])
            self._custody.spooling(message["first"], message["units"])
        elif op == "refused":
            _remember(self._refused, tuple(message["sample"]))
        elif op in ("annotated", "flushed", "sampled"):
            future = self._answers.pop(message["id"], None)
            if future is not None and not future.done():
                if "error" in message:
                    future.set_exception(RewardError(message["error"]))
                else:
                    future.set_result(message.get("where", message.get("given")))
        else:
            super()._on_message(op, message)

    async def _ask(self, message: dict[str, Any]) -> Any:
        writer = self._writer
        if writer is None or writer.is_closing() or self._transport is None:
            raise RuntimeError("the capture process is not running")
        answer_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._answers[answer_id] = future
        self._write_pending()
        writer.write(encode_control({**message, "id": answer_id}))
        return await future

    def _fail_answers(self, why: str) -> None:
        for future in self._answers.values():
            if not future.done():
                future.set_exception(RuntimeError(why))
        self._answers.clear()


def _remember(samples: OrderedDict[tuple[Any, ...], None], sample: tuple[Any, ...]) -> None:
    """Add a refused sample; the oldest go past REFUSED_SAMPLES."""
    samples[sample] = None
    if len(samples) > REFUSED_SAMPLES:
        samples.popitem(last=False)


# --- the child's side ----------------------------------------------------------------------


def main(fd: int) -> None:
    """Entry point of the capture process: `fd` is its end of the socket pair."""
    started = receive_payload(fd)
    settings: Settings = started.payload
    run_helper(
        functools.partial(_serve, started),
        started,
        name="capture process",
        priority=settings.capture_priority,
        log_level=settings.log_level,
        grace=settings.shutdown_grace,
    )


class _HelperSide:
    """The capture process's loop: frames in, the recorder, answers and status out."""

    def __init__(self, recorder: Recorder, reader: FrameReader) -> None:
        self.recorder = recorder
        self.reader = reader
        self.transport = reader.transport
        self.tasks: set[asyncio.Task[None]] = set()
        self.refused: OrderedDict[tuple[Any, ...], None] = OrderedDict()  # named to the proxy
        recorder.capture.on_refused = self._refused
        recorder.capture.unread = reader.unread
        recorder.pipeline.before_write = self._spooling

    def send(self, message: dict[str, Any]) -> None:
        if not self.transport.is_closing():
            self.transport.write(orjson.dumps(message) + b"\n")

    def send_status(self) -> None:
        pipeline = self.recorder.pipeline
        self.send({
            "op": "status",
            "metrics": generate_latest(self.recorder.metrics.registry).decode(),
            "open": self.recorder.open_count,
            "ledger": self.recorder.ledger.snapshot(),
            "spooled_through": pipeline.spool.next_seq if pipeline.spool.opened else None,
            "spool_from": pipeline.opened_at,
            "checks": self.recorder.checks(),
            "backlog": pipeline.backlog,
        })  # fmt: skip

    def _spooling(self, first: int, units: list[int]) -> None:
        """Before a batch is written: the units it carries, so that the proxy, if this process
        dies, counts as lost only what did not reach the spool."""
        self.send({"op": "spooling", "first": first, "units": units,
                   "ledger": self.recorder.ledger.snapshot()})  # fmt: skip

    def send_fatal(self, failure: asyncio.Future[BaseException]) -> None:
        error = failure.result()
        kind = "tokenizer" if isinstance(error, TokenizerError) else "config"
        self.send_status()
        self.send({"op": "fatal", "kind": kind, "message": str(error)})

    def _refused(self, hints: KeyHints) -> None:
        """Name a refused sample to the proxy once, so it stops sending the bodies of its
        calls."""
        sample = hints.sample()
        if sample is None or sample in self.refused:
            return
        _remember(self.refused, sample)
        self.send({"op": "refused", "sample": sample})

    async def run(self) -> float | None:
        """Until the proxy says stop (its timeout) or goes away (None)."""
        recorder = self.recorder
        self._spawn_task(self._report())
        self._spawn_task(self._discovered())
        while True:
            try:
                frame = await self.reader.next()
                if isinstance(frame, LongFrame):
                    decoded = self._take_long(frame)
                    if decoded is None:
                        continue
                    frame = decoded
            except (EOFError, ValueError) as exc:
                if isinstance(exc, ValueError):
                    log.error("the capture process stops reading: %s", exc)
                    self.transport.close()
                return None
            if isinstance(frame, Exchange):
                if frame.dropped == REFUSED:
                    if recorder.admit(frame):  # not expected: the sampler refused it before
                        recorder.metrics.capture_dropped.labels("sampler_changed").inc()
                        recorder.ledger.settle()
                        await recorder.capture.put(frame)
                    continue
                if frame.dropped is not None:  # counted where it was dropped
                    await recorder.capture.put(frame)
                    continue
                if recorder.admit(frame):
                    await recorder.capture.put(frame)
                continue
            op = frame.get("op")
            if op == "flush":
                self._spawn_task(self._flush(frame["id"]))
            elif op == "annotate":
                try:
                    where = await recorder.annotate(frame["outcome"])
                except RewardError as exc:  # checked by the proxy already: not expected
                    self.send({"op": "annotated", "id": frame["id"], "error": str(exc)})
                else:
                    self.send({"op": "annotated", "id": frame["id"], "where": where})
            elif op == "sampling":
                given = await recorder.give_samples(parse_decision(frame["decision"]))
                if "id" in frame:
                    self.send({"op": "sampled", "id": frame["id"], "given": given})
            elif op == "restarted":
                recorder.assembler.follow_restart(float(frame["since"]))
            elif op == "hurry":
                recorder.hurry()
            elif op == "stop":
                return float(frame["timeout"])
            else:
                log.error("unknown control message %r from the proxy", op)

    def _take_long(self, frame: LongFrame) -> Exchange | None:
        """To disk as it came while exchanges wait there (None), else the exchange; its buffer
        goes back to the reader for the next long frame either way."""
        try:
            if self.recorder.capture.spill_long(frame):
                return None
            return frame.decode()
        finally:
            self.reader.give_back(frame.buffer)

    def _spawn_task(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _flush(self, answer_id: int) -> None:
        try:
            await self.recorder.flush()
        except RuntimeError as exc:  # nothing can export: the proxy ends on the failure
            log.error("flush: %s", exc)
            return
        self.send_status()
        self.send({"op": "flushed", "id": answer_id})

    async def _report(self) -> None:
        while True:
            self.send_status()
            await asyncio.sleep(STATUS_EVERY)

    async def _discovered(self) -> None:
        discovery = self.recorder.tokenizer_discovery
        if discovery is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(discovery)
        self.send({"op": "discovered"})


async def _serve(started: Started, life: Lifeline) -> None:
    settings: Settings = started.payload
    loop = asyncio.get_running_loop()
    life.attach(loop)
    transport, reader = await loop.create_connection(
        functools.partial(FrameReader, defer_long=True), sock=started.sock
    )
    metrics = Metrics()
    try:
        recorder = Recorder(
            settings, metrics, queue_bytes=settings.capture_queue_bytes // 2, overflow=True
        )
        await recorder.start()
    except (ConfigError, TokenizerError) as exc:
        transport.write(orjson.dumps({
            "op": "error",
            "kind": "tokenizer" if isinstance(exc, TokenizerError) else "config",
            "message": str(exc),
        }) + b"\n")  # fmt: skip
        transport.close()  # after what is buffered has been written
        await reader.closed
        return
    child = _HelperSide(recorder, reader)
    life.holding()
    child.send({"op": "ready"})
    child.send_status()
    recorder.on_change = child.send_status
    assert recorder.failure is not None
    recorder.failure.add_done_callback(child.send_fatal)
    running = loop.create_task(child.run())
    ended = loop.create_task(life.ended())
    timeout, bounded = settings.shutdown_grace, True
    try:
        await asyncio.wait({running, ended}, return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            asked = running.result()
            if asked is None:  # the proxy is gone
                timeout = life.parent_gone()
            else:
                timeout, bounded = asked, False
        else:  # SIGTERM, or the proxy is gone while we were busy
            timeout = ended.result()
    finally:  # asked to stop, or must: record and export what we can, then leave
        running.cancel()
        ended.cancel()
        recorder.capture.unread = None  # nothing more is taken from the socket
        for task in list(child.tasks):
            task.cancel()
        recorder.on_change = None
        await recorder.stop(timeout, bounded=bounded)
        child.send_status()
        child.send({"op": "stopped"})
        transport.close()
        await reader.closed


if __name__ == "__main__":
    main(int(sys.argv[1]))
