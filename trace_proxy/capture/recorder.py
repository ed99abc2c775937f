"""Everything after the tap, in one object: capture stage → assembler → sampling gate → spool
→ exports. It runs in the capture process (`capture/process.py`), or inline in the proxy's
process when exporter objects are handed to the proxy (tests, embedding) or
`--capture-mode inline` asks for it. The forwarder only sees `admit` and `submit`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver, parse_mapping
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters import create_exporters
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.pipeline import ExportPipeline, Exports
from trace_proxy.exporters.process import ExportProcess
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import SpoolWriter
from trace_proxy.metrics import ExportMetrics, Metrics, children
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.discovery import discover_tokenizers
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.rewards import parse_outcome
from trace_proxy.trajectories.sampler import sampler_of
from trace_proxy.trajectories.token2text import Token2Text, load_configured
from trace_proxy.trajectories.toolparsers import get_parser


class Recorder:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        exporters: list[Exporter] | None = None,
        *,
        queue_bytes: int | None = None,
    ) -> None:
        """Raises ConfigError when the spool directory cannot be used."""
        self.settings = settings
        self.metrics = metrics
        self._inline: ExportRunner | None = None
        self.resolver = MetadataResolver([parse_mapping(rule) for rule in settings.map])
        self.pipeline = self._export_pipeline(exporters)
        closed = children(metrics.trajectories_closed)
        sampler_dropped, sampled = children(metrics.sampler_dropped), children(metrics.sampled)
        self.assembler = Assembler(
            self.pipeline.submit,
            project=settings.project,
            experiment=settings.experiment,
            idle_timeout=settings.idle_timeout,
            step_close_grace=settings.step_close_grace or 0.0,
            defer_finishing=True,  # the capture stage emits closed trajectories in bursts
            on_close=lambda reason: closed(reason).inc(),
            inference=TrafficInference(on_evict=metrics.inference_evicted.inc),
            gate=SamplingGate(
                sampler_of(settings),
                self.pipeline.submit,
                on_drop=lambda what, why: sampler_dropped(what, why).inc(),
                on_count=lambda what, outcome, n: sampled(what, outcome).inc(n),
            ),
        )
        self.capture = CaptureStage(
            self.resolver,
            self.assembler,
            metrics,
            project=settings.project,
            experiment=settings.experiment,
            queue_size=settings.capture_queue,
            queue_bytes=settings.capture_queue_bytes if queue_bytes is None else queue_bytes,
            idle_check_interval=min(settings.idle_timeout / 4, 5.0),
        )
        self.token2text: Token2Text | None = None  # inline exporting only
        self.tokenizer_discovery: asyncio.Future[None] | None = None  # once upstreams answered
        self._session: aiohttp.ClientSession | None = None

    def _export_pipeline(self, exporters: list[Exporter] | None) -> ExportPipeline:
        """Exporters given as objects (tests, embedding) run inline; else as configured."""
        settings = self.settings
        spool_dir = settings.spool_dir or settings.output / ".spool"
        try:
            spool = SpoolWriter(
                spool_dir, max_bytes=settings.spool_max_bytes, fsync_interval=settings.spool_fsync
            )
        except OSError as exc:
            raise ConfigError(f"invalid value for --spool-dir: {exc}") from None
        exports: Exports
        if exporters is None and settings.export_mode == "process":
            exports = ExportProcess(settings, spool_dir, self.metrics)
        else:
            self._export_metrics = ExportMetrics(self.metrics.registry)
            self._inline = ExportRunner(
                spool_dir,
                exporters if exporters is not None else create_exporters(settings),
                self._export_metrics,
            )
            exports = self._inline
        return ExportPipeline(exports, self.metrics, spool, queue_size=settings.export_queue)

    @property
    def backends(self) -> list[str]:
        return self.pipeline.backends

    @property
    def open_count(self) -> int:
        return self.assembler.open_count

    @property
    def held(self) -> int:
        """Exchanges received whose calls are not yet in a closed trajectory: queued, or
        calls of open trajectories (a crash would lose them)."""
        return self.capture.waiting + self.assembler.open_calls

    def admit(self, exchange: Exchange) -> bool:
        return self.capture.admit(exchange)

    def submit(self, exchange: Exchange) -> None:
        self.capture.submit(exchange)

    async def start(self) -> None:
        """Raises TokenizerError (a configured tokenizer cannot be loaded) or ConfigError (a
        backend cannot start, in the export process)."""
        settings = self.settings
        if settings.token2text and self._inline is not None:
            metrics = self._export_metrics
            tokenizers = await asyncio.to_thread(
                load_configured, settings.tokenizer, settings.skip_special_tokens
            )
            self.token2text = Token2Text(
                tokenizers,
                get_parser(settings.tool_parser),
                on_skip=lambda reason: metrics.token2text_skipped.labels(reason).inc(),
            )
            self._inline.add_processor(self.token2text)
            if self.token2text.tokenizers.empty:
                self._session = aiohttp.ClientSession()  # discovery only, off the hot path
                self.tokenizer_discovery = asyncio.get_running_loop().create_task(
                    discover_tokenizers(
                        self._session,
                        settings.upstream,
                        self.token2text.tokenizers,
                        settings.skip_special_tokens,
                    )
                )
        await self.pipeline.start()
        if isinstance(self.pipeline.exports, ExportProcess):
            self.tokenizer_discovery = self.pipeline.exports.tokenizer_discovery
        self.capture.start()

    async def flush(self) -> None:
        """Everything submitted so far is parsed and assembled, and what it closed is exported
        by every backend (or counted)."""
        await self.capture.drain()
        await self.pipeline.flush()

    async def annotate(self, payload: Any) -> str:
        """Attach a reward (RewardError when it is not one): where its trajectory was."""
        where = self.assembler.annotate(parse_outcome(payload))
        self.metrics.rewards.labels(where).inc()
        return where

    async def stop(self, timeout: float) -> None:
        """Parse what is queued, close every trajectory, export or count every record."""
        if self.tokenizer_discovery is not None:
            self.tokenizer_discovery.cancel()
        await self.capture.stop()
        await self.pipeline.close(timeout)
        if self._session is not None:
            await self._session.close()
