"""Everything after the tap, in one object: capture stage → assembler → sampling gate → spool
→ exports. It runs in the capture process (`capture.py`), or inline in the proxy's
process when exporter objects are handed to the proxy (tests, embedding) or
`--capture-mode inline` asks for it. The forwarder only sees `admit` and `submit`.

Starting does not wait for the spool's lock or for the exporters (loading tokenizers, importing
SDKs): exchanges are taken at once, and `checks` says what is still starting. A configuration
error found on the way (a tokenizer, a backend, a spool held by another proxy) is `failure`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.overflow import Overflow
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters import create_exporters
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.pipeline import ExportPipeline, Exports
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import SpoolBusy, SpoolWriter
from trace_proxy.metrics import ExportMetrics, Metrics, children
from trace_proxy.processes.export import ExportProcess, export_runner
from trace_proxy.processes.helper import proxy_pid
from trace_proxy.processes.lifeline import leftover_wait
from trace_proxy.processes.text_path import (
    add_token2text,
    discover_served,
    load_tokenizers,
    needs_discovery,
)
from trace_proxy.store.names import store_name_notes
from trace_proxy.text.token2text import Token2Text, TokenizerError
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.ledger import Ledger
from trace_proxy.trajectories.rewards import Outcome, parse_outcome
from trace_proxy.trajectories.sampler import StepDecision, sampler_of


class Recorder:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        exporters: list[Exporter] | None = None,
        *,
        queue_bytes: int | None = None,
        overflow: bool = False,
        resolver: MetadataResolver | None = None,
    ) -> None:
        """Raises ConfigError when the spool directory cannot be used. `overflow`: exchanges
        the capture queue cannot hold wait on disk (see overflow.py) instead of in the
        forwarder's buffer (the capture process). `resolver`: the proxy's, when it runs in the
        proxy's process (else one is made from `--map`)."""
        self.settings = settings
        self.metrics = metrics
        self._inline: ExportRunner | None = None
        self._exports_started = False
        self._starting: asyncio.Task[None] | None = None
        self.failure: asyncio.Future[BaseException] | None = None  # made in start()
        self.on_change: Callable[[], None] | None = None
        self.resolver = resolver or MetadataResolver.of(settings.map)
        self.ledger = Ledger()  # where each exchange is, for the proxy if this process dies
        self.pipeline = self._export_pipeline(exporters)
        closed = children(metrics.trajectories_closed)
        self.inference = TrafficInference(on_evict=metrics.inference_evicted.inc)
        sampler_dropped, sampled = children(metrics.sampler_dropped), children(metrics.sampled)
        self.gate = SamplingGate(
            sampler_of(settings),
            self.pipeline.submit,
            on_drop=lambda what, why: sampler_dropped(what, why).inc(),
            on_count=lambda what, outcome, n: sampled(what, outcome).inc(n),
            ledger=self.ledger,
        )
        self.assembler = Assembler(
            self.pipeline.submit,
            project=settings.project,
            experiment=settings.experiment,
            idle_timeout=settings.idle_timeout,
            step_close_grace=settings.step_close_grace or 0.0,
            defer_finishing=True,  # the capture stage emits closed trajectories in bursts
            ledger=self.ledger,
            on_close=lambda reason: closed(reason).inc(),
            inference=self.inference,
            gate=self.gate,
            key_notes=store_name_notes,
        )
        self._annotating: dict[asyncio.Future[None], Outcome] = {}  # rewards waiting to be placed
        self.capture = CaptureStage(
            self.resolver,
            self.assembler,
            metrics,
            project=settings.project,
            experiment=settings.experiment,
            queue_size=settings.capture_queue,
            queue_bytes=settings.capture_queue_bytes if queue_bytes is None else queue_bytes,
            idle_check_interval=min(settings.idle_timeout / 4, 5.0),
            ledger=self.ledger,
            overflow=Overflow(self.pipeline.spool_dir, settings.capture_overflow_bytes)
            if overflow and settings.capture_overflow_bytes > 0
            else None,
        )
        self.token2text: Token2Text | None = None  # inline exporting only
        self.tokenizer_discovery: asyncio.Future[None] | None = None  # once upstreams answered
        self._discovering: asyncio.Task[None] | None = None
        self._inference_tokenizers: asyncio.Task[None] | None = None
        # Done once --tokenizer's decoders are ready for inference (or could not be loaded).
        self.decoders: asyncio.Future[None] | None = None
        self._decoders_failed: BaseException | None = None

    def _export_pipeline(self, exporters: list[Exporter] | None) -> ExportPipeline:
        """Exporters given as objects (tests, embedding) run inline; else as configured."""
        settings = self.settings
        spool_dir = settings.spool_path
        try:  # the lock is taken as the pipeline starts: a leftover may still hold it
            spool = SpoolWriter(
                spool_dir,
                max_bytes=settings.spool_max_bytes,
                fsync_interval=settings.spool_fsync,
                locked=False,
                proxy=proxy_pid(),
            )
        except OSError as exc:
            raise ConfigError(f"invalid value for --spool-dir: {exc}") from None
        wait = leftover_wait(settings.shutdown_grace)
        exports: Exports
        if exporters is None and settings.export_mode == "process":
            exports = ExportProcess(settings, spool_dir, self.metrics)
            exports.on_change = self._changed
        else:
            self._export_metrics = ExportMetrics(self.metrics.registry)
            self._inline = export_runner(
                settings,
                spool_dir,
                self._export_metrics,
                exporters if exporters is not None else create_exporters(settings),
            )
            exports = self._inline
        pipeline = ExportPipeline(
            exports,
            self.metrics,
            spool,
            queue_size=settings.export_queue,
            lock_wait=wait,
            ledger=self.ledger,
        )
        pipeline.on_change = self._changed
        pipeline.on_failure = self._spool_failed
        return pipeline

    def _spool_failed(self, error: BaseException) -> None:
        if isinstance(error, SpoolBusy):
            self._fail(ConfigError(str(error)))
        else:
            self._fail(ConfigError(f"invalid value for --spool-dir: {error}"))

    @property
    def backends(self) -> list[str]:
        return self.pipeline.backends

    @property
    def open_count(self) -> int:
        return self.assembler.open_count

    def admit(self, exchange: Exchange) -> bool:
        return self.capture.admit(exchange)

    def submit(self, exchange: Exchange) -> None:
        self.capture.submit(exchange)

    async def start(self) -> None:
        """Take exchanges from now on; the spool and the exporters start in the background
        (`checks`; a configuration error they find is `failure`)."""
        loop = asyncio.get_running_loop()
        self.failure = loop.create_future()
        self.tokenizer_discovery = loop.create_future()
        self.capture.start()
        self.pipeline.start_writing()
        if self.settings.tokenizer:
            self.decoders = loop.create_future()
            self.capture.wait_for_decoders(self.decoders)
        self._starting = loop.create_task(self._start_exports())
        if self.settings.tokenizer and (self._inline is None or not self.settings.token2text):
            self._inference_tokenizers = loop.create_task(self._load_inference_tokenizers())

    async def _load_inference_tokenizers(self) -> None:
        """The `--tokenizer`s here too, for telling apart continuations of replies that came
        as text only (`TrafficInference`); calls that need them wait for them (see
        `CaptureStage.wait_for_decoders`). With token2text, the export process loads its own
        and reports what fails to load; else a failure here is the proxy's."""
        settings = self.settings
        try:
            self.inference.tokenizers = await load_tokenizers(settings)
        except TokenizerError as exc:
            self._decoders_failed = exc
            if not settings.token2text:
                self._fail(exc)
        finally:
            _settle(self.decoders)
            self._changed()

    async def _start_exports(self) -> None:
        exports = self.pipeline.exports
        try:
            if self._inline is not None:
                await self._start_inline()
            await exports.start()
        except (ConfigError, TokenizerError, SpoolBusy) as exc:
            self._fail(exc if not isinstance(exc, SpoolBusy) else ConfigError(str(exc)))
            _settle(self.decoders)  # nothing waits for a tokenizer that will not come
            return
        self._exports_started = True
        self._changed()
        if isinstance(exports, ExportProcess):
            assert exports.failure is not None and exports.tokenizer_discovery is not None
            exports.failure.add_done_callback(lambda failed: self._fail(failed.result()))
            _chain(exports.tokenizer_discovery, self.tokenizer_discovery)

    async def _start_inline(self) -> None:
        """Exporters in this process: token2text's tokenizers (shared with inference), then
        the runner."""
        assert self._inline is not None
        try:
            self.token2text = await add_token2text(
                self.settings, self._inline, self._export_metrics
            )
        except asyncio.CancelledError:  # a stop gave up on the exporters' start
            _settle(self.decoders)  # nothing else would load them: calls wait no longer
            raise
        if self.token2text is None:
            _settle(self.tokenizer_discovery)
            return
        self.inference.tokenizers = self.token2text.tokenizers
        _settle(self.decoders)
        if not needs_discovery(self.token2text):
            _settle(self.tokenizer_discovery)
            return
        discovery = asyncio.get_running_loop().create_task(
            discover_served(self.settings, self.token2text.tokenizers)
        )
        self._discovering = discovery
        assert self.tokenizer_discovery is not None
        _chain(discovery, self.tokenizer_discovery)

    def _fail(self, error: BaseException) -> None:
        if self.failure is not None and not self.failure.done():
            self.failure.set_result(error)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def checks(self) -> dict[str, str]:
        """For /ready: the exporters, the spool, and the tokenizers when token2text is on
        ("ok", or what each is doing)."""
        failure = self.failure.result() if self.failure and self.failure.done() else None
        exports = self.pipeline.exports
        if isinstance(exports, ExportProcess):
            export = exports.check
        elif self._exports_started:
            export = "ok"
        else:
            export = f"failed: {failure}" if failure is not None else "starting"
        checks = {"export": export, "spool": self.pipeline.spool_check}
        if self.settings.token2text:  # loaded as the exporters start
            if isinstance(failure, TokenizerError):
                checks["tokenizer"] = f"failed: {failure}"
            elif export == "ok":
                checks["tokenizer"] = "ok"
            elif export.startswith("starting"):
                checks["tokenizer"] = "loading"
            else:
                checks["tokenizer"] = "not loaded: the exporters are not running"
        if self.decoders is not None and checks.get("tokenizer", "ok") == "ok":
            # --tokenizer is loaded for inference too (telling rollouts apart), with or
            # without token2text
            if not self.decoders.done():
                checks["tokenizer"] = "loading"
            elif self._decoders_failed is not None:
                checks["tokenizer"] = f"failed: {self._decoders_failed}"
            else:
                checks["tokenizer"] = "ok"
        return checks

    def hurry(self) -> None:
        """Shutdown has begun: the exporters may use more CPU to drain the spool in time."""
        self.pipeline.hurry()

    async def flush(self) -> None:
        """Everything submitted so far is parsed and assembled, and what it closed is exported
        by every backend (or counted), rewards posted so far included."""
        await self.capture.drain()
        while self._annotating:  # rewards that waited for parsing, then what they closed
            await asyncio.gather(*list(self._annotating))
            await self.capture.drain()
        assert self.failure is not None, "start() first"
        flushing = asyncio.ensure_future(self.pipeline.flush())
        waits: list[asyncio.Future[Any]] = [flushing, self.failure]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not flushing.done():  # nothing will ever export them
            flushing.cancel()
            raise RuntimeError(f"records cannot be exported: {self.failure.result()}")
        await flushing

    async def give_samples(self, decision: StepDecision) -> bool:
        """A step's kept samples, decided by whoever saw its whole batch; False when this
        proxy does not keep a number of samples per step of that kind."""
        return self.gate.give(decision)

    async def annotate(self, payload: Any) -> str:
        """Attach a reward (RewardError when it is not one): where its trajectory was, or
        `queued` when the calls forwarded before it are still being parsed: it waits for them,
        so it finds the trajectory they belong to (a trainer posts a rollout's reward as soon
        as its last answer came back, and a `done` closes what they belong to); the caller
        does not wait."""
        outcome = parse_outcome(payload)
        if not self.capture.is_caught_up:
            task = asyncio.ensure_future(self._annotate_when_caught_up(outcome))
            self._annotating[task] = outcome
            task.add_done_callback(lambda done: self._annotating.pop(done, None))
            return "queued"
        return self._annotate(outcome)

    async def _annotate_when_caught_up(self, outcome: Outcome) -> None:
        await self.capture.caught_up()
        self._annotate(outcome)

    def _annotate(self, outcome: Outcome) -> str:
        where = self.assembler.annotate(outcome)
        self.metrics.rewards.labels(where).inc()
        return where

    async def stop(self, timeout: float, *, bounded: bool = False) -> None:
        """Parse what is queued, close every trajectory, export or count every record. With
        `bounded`, all of it within `timeout` (parsing within half of it; what is not parsed
        then is counted): the helper process holding it must end."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        self.hurry()
        if self._discovering is not None:
            self._discovering.cancel()
        starting = self._starting
        if starting is not None and not starting.done():  # the exporters get the time to start
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(starting), timeout / 2)
            starting.cancel()  # given up: what they would export stays in the spool
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        # The tokenizer still loading: the calls that wait for it (a client that ran its whole
        # rollout in the first seconds) get it, within `timeout` (half of the parsing time
        # when bounded), instead of being marked ambiguous for want of it.
        parse_within = timeout / 2 if bounded else None
        await self.capture.stop(parse_within, decoders_within=None if bounded else timeout)
        if self._inference_tokenizers is not None:
            self._inference_tokenizers.cancel()  # nothing waits for it any longer
        for task, outcome in list(self._annotating.items()):
            # Parsed, or counted as dropped, by now: a reward still waiting is placed at once.
            if not task.done() and task.cancel():
                self._annotate(outcome)
        left = timeout - (loop.time() - began) if bounded else timeout
        await self.pipeline.close(max(left, 0.0))


def _settle(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _chain(source: asyncio.Future[None], target: asyncio.Future[None] | None) -> None:
    """`target` is done when `source` is (whatever its outcome: discovery gave up, or ran)."""

    def done(source: asyncio.Future[None]) -> None:
        if not source.cancelled():
            source.exception()  # retrieved: a discovery that failed has logged why
        _settle(target)

    source.add_done_callback(done)
