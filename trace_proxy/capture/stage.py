"""The capture stage: exchanges in, off the forwarding path, in arrival order; its intake and
backpressure (a bounded queue, the overflow on disk, bursts of parsing while behind, waiting
for the tokenizer) and its waits (flush, drain, stop). What each exchange becomes is decided
by `dispatch.py`.

The forwarder drops each finished exchange into a bounded queue (never waiting); one task here
hands them, in arrival order, to the dispatcher, which feeds the assembler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from trace_proxy.capture.dispatch import Dispatcher, Parsed
from trace_proxy.capture.exchange import Exchange, dropped_mark
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.overflow import Overflow, OverflowLost
from trace_proxy.capture.routes import RouteKind, classify
from trace_proxy.capture.wire import LongFrame
from trace_proxy.logtext import printable
from trace_proxy.metrics import Metrics, children
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.keys import KeyHints
from trace_proxy.trajectories.ledger import Ledger

log = logging.getLogger(__name__)
BEHIND = 32  # exchanges waiting: parsing is falling behind forwarding
BURST = 0.002  # seconds of parsing per turn of the event loop while behind
# Seconds the worker, once it has parsed everything, lets exchanges gather before it parses
# again. At a rollout's pace exchanges came a few at a time, each parse a wake-up of a process
# whose caches the client and the servers had meanwhile taken: 20% less CPU per call in bursts.
GATHER = 0.03


# Seconds, from the start, that calls may wait for the inference tokenizer to load: it takes a
# few seconds on a quiet machine; a call that would be told apart by decoding waits rather
# than start a trajectory marked ambiguous.
DECODER_WAIT = 120.0


class CaptureStage:
    def __init__(
        self,
        resolver: MetadataResolver,
        assembler: Assembler,
        metrics: Metrics,
        *,
        project: str,
        experiment: str,
        queue_size: int,
        idle_check_interval: float,
        queue_bytes: int = 512 << 20,
        ledger: Ledger | None = None,
        gather: float = GATHER,
        overflow: Overflow | None = None,
    ) -> None:
        """`overflow`: where `put` leaves exchanges while the queue is full, instead of
        waiting for room (the capture process: see overflow.py)."""
        self._resolver = resolver
        self._ledger = ledger if ledger is not None else Ledger()
        self._assembler = assembler
        self._metrics = metrics
        self._dispatch = Dispatcher(
            resolver, assembler, metrics, self._ledger, project=project, experiment=experiment
        )
        self._queue: asyncio.Queue[Exchange] = asyncio.Queue(maxsize=queue_size)
        self._max_bytes = queue_bytes
        self._queued_bytes = 0
        self._room = asyncio.Event()  # set whenever an exchange leaves the queue
        self._overflow = overflow
        self._overflowing = asyncio.Event()  # set while the overflow holds exchanges
        self._overflow_empty = asyncio.Event()
        self._overflow_empty.set()
        self._disk_refused = False  # logged once, until the disk takes one again
        self._overflowing_told = False  # logged the first time only: bursts are usual
        self._gather = gather
        self._gathering: asyncio.Future[None] | None = None  # the worker's wait, while it lasts
        self._draining = 0  # drains and stops under way: no gathering while they wait
        self._idle_check_interval = idle_check_interval
        self._tasks: list[asyncio.Task[None]] = []
        self._decoders: asyncio.Future[None] | None = None  # while the tokenizer loads
        self.waiting_for_decoders = False  # a call waits for the tokenizer right now
        self._decoder_deadline = 0.0
        self._decoders_given_up: asyncio.Future[None] | None = None  # ends a wait under way
        self._decoder_waits = children(metrics.inference_decoder_waits)
        # Are exchanges still to be read (the capture process's socket)? Between bursts of
        # parsing, reading comes first (see `_intake_first`).
        self.unread: Callable[[], bool] | None = None
        self._putting = 0  # puts under way: one that waits for room waits for parsing
        # Told the hints of each call `admit` refuses (the sampler's refusals are final).
        self.on_refused: Callable[[KeyHints], None] | None = None
        # Refused calls that name a newer step than any before them in their run, each with
        # how many exchanges had been queued before it: told to the assembler once those are
        # processed, so the refusal, decided on arrival, moves steps on in arrival order.
        self._queued = 0  # exchanges put in the queue, ever
        self._processed = 0  # of those, taken out and processed
        self._step_marks: deque[tuple[int, KeyHints]] = deque()
        self._caught_up: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._newest_step: dict[tuple[Any, Any, bool], int] = {}
        # Read when the metrics are: setting them on every exchange was a few % of parsing.
        metrics.open_trajectories.set_function(lambda: assembler.open_count)
        metrics.capture_queue.set_function(lambda: self._queue.qsize() + self._overflow_count)
        if overflow is not None:
            metrics.capture_overflow_bytes.set_function(lambda: overflow.disk_bytes)

    @property
    def _overflow_count(self) -> int:
        return 0 if self._overflow is None else self._overflow.count

    def admit(self, exchange: Exchange) -> bool:
        """On the hot path: False when the headers name a sample the sampler has dropped, so
        nothing of the exchange needs keeping. Cheap: headers only, no body; nothing at all
        when the sampler keeps everything."""
        if not self._assembler.samples_early:
            return True
        hints = self._resolver.resolve(exchange.request_headers, exchange.path_metadata, None)
        verdict = self._assembler.admit_early(hints)
        if verdict is False:
            self._metrics.capture_dropped.labels("sampler").inc()
            self._ledger.settle()
            if self.on_refused is not None:
                self.on_refused(hints)
            if self._newer_step(hints):
                self._step_marks.append((self._queued, hints))
                self._tell_steps()
            return False
        exchange.admitted = verdict is True
        return True

    def _newer_step(self, hints: KeyHints) -> bool:
        """Does a refused call name a later step of its run than any refused before it?
        (Only those can move the assembler's steps on: one mark a step, not one a call.)"""
        step = hints.values.get("step")
        if step is None:
            return False
        v = hints.values
        run = (v.get("project"), v.get("experiment"), bool(v.get("validate")))
        if step <= self._newest_step.get(run, -1):
            return False
        self._newest_step[run] = step
        return True

    def _tell_steps(self) -> None:
        """Step marks whose predecessors have all been processed, to the assembler."""
        marks = self._step_marks
        while marks and marks[0][0] <= self._processed:
            self._assembler.see_step(marks.popleft()[1])

    def submit(self, exchange: Exchange) -> None:
        """Called by the forwarder; never blocks, never raises."""
        size = len(exchange.request_body) + sum(map(len, exchange.response_chunks))
        if self._over_bytes(size):
            self._metrics.capture_dropped.labels("capture_queue_bytes").inc()
            if not self._queue.full():  # a mark holds no body: the count bounds them
                self._queue.put_nowait(dropped_mark(exchange, "capture_queue_bytes"))
                self._queued += 1
            return
        try:
            self._queue.put_nowait(exchange)
        except asyncio.QueueFull:
            self._metrics.capture_dropped.labels("capture_queue_full").inc()
            return
        self._queued += 1
        exchange.size = size
        self._queued_bytes += size
        self._hurry_when_full()

    async def put(self, exchange: Exchange) -> None:
        """In the capture process: wait for room instead of dropping, so that the backlog
        stays on the forwarding side, which bounds it and counts what it cannot hold. With an
        overflow, what the queue cannot hold waits there instead, in order, and only a full
        overflow makes this wait."""
        self._putting += 1  # seen by the worker only while this waits (see `_intake_first`)
        try:
            await self._put(exchange)
        finally:
            self._putting -= 1

    async def _put(self, exchange: Exchange) -> None:
        size = len(exchange.request_body) + sum(map(len, exchange.response_chunks))
        overflow = self._overflow
        while overflow is not None and (overflow.count or self._no_room_for(size)):
            if self._spill(overflow, exchange):
                return
            self._room.clear()  # set as the queue or the overflow empties
            self._hurry()
            await self._room.wait()
        while self._over_bytes(size):
            self._room.clear()
            self._hurry()
            await self._room.wait()
        await self._queue.put(exchange)
        self._queued += 1
        exchange.size = size
        self._queued_bytes += size
        self._hurry_when_full()

    def spill_long(self, frame: LongFrame) -> bool:
        """In the capture process, before a long frame is decoded: when exchanges wait on
        disk already (or the queue has no room for it), it joins them as it came, which
        costs a write instead of a decode, copies and an encode (a sampler that decides on
        headers needs them first: then not). False: nothing done; decode it and `put` it."""
        overflow = self._overflow
        if (
            overflow is None
            or not (overflow.count or self._no_room_for(frame.size))
            or self._assembler.samples_early
            or frame.dropped is not None
        ):
            return False
        return self._spill(overflow, frame)

    def _intake_first(self) -> bool:
        """Should parsing let exchanges be read first? On a core the forwarder keeps busy this
        process gets what forwarding leaves, and what it does not read in time waits in the
        forwarder's buffer, which drops calls once full; what it reads can wait in its queue,
        then on disk. Taking one in (reading it, writing it to disk) costs about a quarter of
        parsing it at 32k-token prompts (benchmarks/intake.py), so between bursts of parsing
        everything waiting to be read is read first. Not while a `put` waits (for room, which
        only parsing makes), nor while a flush or a stop waits for parsing."""
        return (
            not self._putting and not self._draining and self.unread is not None and self.unread()
        )

    def _over_bytes(self, size: int) -> bool:
        """Past the byte budget with `size` more (a queue holds one exchange whatever size)."""
        return self._queued_bytes + size > self._max_bytes and not self._queue.empty()

    def _no_room_for(self, size: int) -> bool:
        return self._queue.full() or self._over_bytes(size)

    def _spill(self, overflow: Overflow, exchange: Exchange | LongFrame) -> bool:
        """Leave the exchange in the overflow, if it has room and the disk takes it."""
        try:
            if not overflow.append(exchange):
                return False
        except OSError as exc:
            if not self._disk_refused:
                log.error("exchanges wait for parsing in memory only: the disk refused: %s", exc)
            self._disk_refused = True
            return False
        if overflow.count == 1:
            if not self._overflowing_told:
                self._overflowing_told = True
                log.info("parsing is behind forwarding: exchanges wait for it on disk, up to "
                         "%d bytes (trace_proxy_capture_overflowed counts them)",
                         overflow.max_bytes)  # fmt: skip
            self._overflowing.set()
            self._overflow_empty.clear()
        self._disk_refused = False
        self._queued += 1
        self._metrics.capture_overflowed.inc()
        self._hurry()
        return True

    async def _refill(self) -> None:
        """Move exchanges from the overflow to the queue as it has room, oldest first."""
        overflow = self._overflow
        assert overflow is not None
        while True:
            await self._overflowing.wait()
            try:
                while overflow.count:
                    if self._no_room_for(overflow.next_size()):
                        self._room.clear()
                        await self._room.wait()
                        continue
                    exchange = overflow.pop()
                    self._queue.put_nowait(exchange)
                    self._queued_bytes += exchange.size
                    self._hurry_when_full()
            except OverflowLost as exc:
                self._lose_overflow(str(exc))
            self._overflowing.clear()
            self._overflow_empty.set()
            self._room.set()  # a put waiting for the overflow's room may go on

    def _lose_overflow(self, why: str) -> None:
        """The overflow cannot be read back: what it holds is counted as dropped."""
        assert self._overflow is not None
        lost = self._overflow.count
        self._overflow.close()
        self._ledger.settle(lost)
        # The newest exchanges, never to be parsed: no one waits for them any longer.
        self._queued -= lost
        queued = self._queued
        self._caught_up = deque((min(at, queued), done) for at, done in self._caught_up)
        self._step_marks = deque((min(at, queued), hints) for at, hints in self._step_marks)
        self._wake_waiters()
        self._metrics.capture_dropped.labels("capture_overflow").inc(lost)
        log.error("%d exchanges waiting on disk are lost: %s", lost, why)

    def _filling(self) -> bool:
        """The queue is filling: parsing must not wait for exchanges to gather."""
        return self._queue.qsize() >= BEHIND or self._queued_bytes > self._max_bytes // 2

    def _hurry_when_full(self) -> None:
        if self._filling():
            self._hurry()

    def _hurry(self) -> None:
        """Someone waits for parsing, or the queue fills: the worker gathers no longer."""
        gathering = self._gathering
        if gathering is not None and not gathering.done():
            gathering.set_result(None)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work()), loop.create_task(self._close_idle())]
        if self._overflow is not None:
            self._tasks.append(loop.create_task(self._refill()))

    @property
    def is_caught_up(self) -> bool:
        return self._processed >= self._queued

    async def caught_up(self) -> None:
        """Wait until every exchange queued so far is processed (not those queued later:
        under steady traffic the queue may never be empty). A trajectory's end, told after
        its last call, thus finds that call assembled."""
        target = self._queued
        if self._processed >= target:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._caught_up.append((target, waiter))
        self._hurry()
        await waiter

    async def drain(self) -> None:
        """Wait until every exchange submitted so far has been parsed and assembled, and every
        trajectory closed meanwhile has been emitted."""
        self._draining += 1
        self._hurry()
        try:
            await self._parsed_all()
        finally:
            self._draining -= 1
        await self._finish_closed()

    async def _parsed_all(self) -> None:
        """Until the queue and the overflow are both empty and every exchange is parsed."""
        while True:
            await self._overflow_empty.wait()
            await self._queue.join()
            if self._overflow_empty.is_set():
                return

    async def stop(
        self, parse_within: float | None = None, decoders_within: float | None = None
    ) -> None:
        """Parse everything already queued (within `parse_within` seconds, if given: what is
        left then counts in its trajectory as a dropped call, `shutdown`), then close every
        open trajectory. A call waiting for the tokenizer still loading (`wait_for_decoders`)
        waits for it up to `decoders_within` seconds more (by default half of `parse_within`):
        what is queued behind it is then parsed in the time left, not counted dropped."""
        self._draining += 1  # never undone: the worker stops below
        self._hurry()
        if decoders_within is None and parse_within is not None:
            decoders_within = parse_within / 2
        give_up = (
            asyncio.get_running_loop().call_later(decoders_within, self._give_up_decoders)
            if decoders_within is not None and self._decoders is not None
            else None
        )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._parsed_all(), parse_within)
        if give_up is not None:
            give_up.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = 0
        for exchange in self._left_at_stop():
            if exchange.dropped is None:
                left += 1
                exchange = dropped_mark(exchange, "shutdown")
            self.process(exchange)
        if left:
            self._ledger.settle(left)
            self._metrics.capture_dropped.labels("shutdown").inc(left)
            log.error("%d exchanges not parsed within %.1f s of stopping: counted as dropped",
                      left, parse_within)  # fmt: skip
        self._assembler.close_all("shutdown")

    def _left_at_stop(self) -> Iterator[Exchange]:
        """What was not parsed in time, oldest first: the queue's, then the overflow's heads
        (their bodies are not read: they become the marks of dropped calls)."""
        while not self._queue.empty():
            yield self._queue.get_nowait()
        overflow = self._overflow
        if overflow is None:
            return
        try:
            while overflow.count:
                yield overflow.pop_head()
        except OverflowLost as exc:
            self._lose_overflow(str(exc))
        overflow.close()

    def wait_for_decoders(self, loaded: asyncio.Future[None], within: float | None = None) -> None:
        """Calls that decoding would tell apart wait for `loaded` (the inference tokenizer
        loaded, or given up), for up to `within` seconds (DECODER_WAIT) from now in all."""
        self._decoders = loaded
        within = DECODER_WAIT if within is None else within
        self._decoder_deadline = asyncio.get_running_loop().time() + within

    async def _work(self) -> None:
        burst_started = time.perf_counter()
        assembler = self._assembler
        while True:
            exchange = await self._queue.get()
            if self._decoders is not None and self._decoders.done():
                self._decoders = None
            if self._decoders is None:
                self._handle(exchange)
            else:  # the first seconds with --tokenizer
                await self._handle_once_decodable(exchange)
            if assembler.pending:  # trajectories this closed: at least one, within the budget
                self._run_pending(until=burst_started + BURST)
            # Queue.get() does not yield while items wait: without a yield a backlog would be
            # parsed in one burst, and no request could be forwarded meanwhile. One item per
            # turn of the loop, though, falls behind a saturated proxy until the queue
            # overflows: past BEHIND waiting, parse for up to BURST seconds per turn.
            if self._queue.qsize() < BEHIND or time.perf_counter() - burst_started >= BURST:
                await asyncio.sleep(0)
                while self._intake_first():
                    await asyncio.sleep(0)
                burst_started = time.perf_counter()
                if self._queue.empty():
                    await self._finish_closed()
                    await self._let_gather()

    async def _let_gather(self) -> None:
        """Wait up to `gather` seconds for exchanges to gather, unless someone waits for
        parsing (a flush, a reward's `done`, a drain, a stop), the queue fills or more waits on
        disk."""
        behind = self._filling() or self._overflow_count > 0
        if self._gather <= 0 or self._caught_up or self._draining or behind:
            return
        # A future and a timer, not `wait_for`: on Python 3.11 `wait_for` can swallow the
        # cancellation that stops the worker when its wait ends at the same moment.
        loop = asyncio.get_running_loop()
        self._gathering = gathering = loop.create_future()
        timer = loop.call_later(self._gather, _settle, gathering)
        try:
            await gathering
        finally:
            timer.cancel()
            self._gathering = None

    def process_waiting(self) -> bool:
        """Process the exchange that has waited longest, if any (what the worker does; for
        driving the stage step by step)."""
        try:
            exchange = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return False
        self._handle(exchange)
        return True

    async def _handle_once_decodable(self, exchange: Exchange) -> None:
        """Handle `exchange`, once the tokenizer has loaded if one of its calls needs it to be
        told apart from other rollouts (bounded: `wait_for_decoders`). Parsed once."""
        parsed = None
        try:
            kind = classify(exchange.method, exchange.path)
            if (
                kind is RouteKind.GENERATE
                and exchange.dropped is None
                and (exchange.tool_route is None and exchange.bodies_skipped is None)
            ):
                parsed = self._dispatch.parse(exchange)
                assembler = self._assembler
                if any(assembler.needs_decoder(hints, call) for hints, call, _ in parsed.calls):
                    await self._wait_for_decoders()
                    still = any(assembler.needs_decoder(h, c) for h, c, _ in parsed.calls)
                    self._decoder_waits("no_decoder" if still else "decoded").inc()
        except Exception:  # `_handle` parses again, and counts what fails
            log.exception("waiting for the tokenizer failed")
            parsed = None
        finally:
            self._handle(exchange, parsed)

    async def _wait_for_decoders(self) -> None:
        decoders = self._decoders
        if decoders is None:
            return
        loop = asyncio.get_running_loop()
        left = self._decoder_deadline - loop.time()
        if left > 0:
            self.waiting_for_decoders = True
            self._decoders_given_up = given_up = loop.create_future()
            try:  # `wait` never cancels what it waits for
                await asyncio.wait(
                    {decoders, given_up}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                self.waiting_for_decoders = False
                self._decoders_given_up = None
        self._decoders = None  # loaded, given up, or waited for as long as allowed

    def _give_up_decoders(self) -> None:
        """A stop's budget for the tokenizer is spent: no call waits for it any longer."""
        self._decoder_deadline = 0.0
        if self._decoders_given_up is not None:
            _settle(self._decoders_given_up)

    def _handle(self, exchange: Exchange, parsed: Parsed | None = None) -> None:
        try:
            self.process(exchange, parsed)
        except Exception:
            self._metrics.capture_dropped.labels("internal_error").inc()
            log.exception("capturing %s %s failed", exchange.method, printable(exchange.path))
        finally:
            self._queue.task_done()
            self._processed += 1
            self._wake_waiters()
            self._queued_bytes -= exchange.size
            self._room.set()

    def _wake_waiters(self) -> None:
        if self._step_marks:
            self._tell_steps()
        waiting = self._caught_up
        while waiting and waiting[0][0] <= self._processed:
            done = waiting.popleft()[1]
            if not done.done():
                done.set_result(None)

    async def _finish_closed(self) -> None:
        """Emit closed trajectories in bursts, yielding between them: a step change can close
        thousands at once, and building them must not hold up forwarding."""
        while self._assembler.pending:
            self._run_pending(until=time.perf_counter() + BURST)
            await asyncio.sleep(0)

    def _run_pending(self, until: float) -> None:
        """Finish closed trajectories. One that cannot be built is lost, and counted: an
        exception here would end the task that parses every exchange."""
        try:
            self._assembler.run_pending(until=until)
        except Exception:
            self._metrics.capture_dropped.labels("internal_error").inc()
            log.exception("finishing a closed trajectory failed")

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(self._idle_check_interval)
            self._assembler.close_idle()
            await self._finish_closed()

    def process(self, exchange: Exchange, parsed: Parsed | None = None) -> None:
        """Parse and record one exchange (`parsed`: its calls, when already parsed)."""
        self._dispatch.process(exchange, parsed)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
