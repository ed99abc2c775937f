"""One running proxy, with an explicit lifecycle: start, serve, stop (drain, then flush).

The listener is aiohttp's low-level `web.Server` (no router, no middlewares: every request goes
to the forwarder). Stopping follows the order that keeps every record: stop accepting, let
in-flight requests finish within the grace period, parse what was captured, close every open
trajectory, export or count everything, then close the upstream connections.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from trace_proxy.capture.metadata import MetadataResolver, parse_mapping
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters import create_exporters
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.pipeline import ExportPipeline, Exports
from trace_proxy.exporters.process import ExportProcess
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.exporters.spool import SpoolWriter
from trace_proxy.metrics import ExportMetrics, Metrics
from trace_proxy.proxy.forward import Forwarder
from trace_proxy.proxy.upstream_client import UpstreamClient
from trace_proxy.proxy.upstreams import Upstream, UpstreamPool
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.discovery import discover_tokenizers
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.rewards import RewardError, parse_outcome
from trace_proxy.trajectories.sampler import Policy, Sampler
from trace_proxy.trajectories.token2text import Token2Text, load_configured
from trace_proxy.trajectories.toolparsers import get_parser

log = logging.getLogger(__name__)
# Thousands of rollout workers may connect at once; the kernel caps this at somaxconn.
LISTEN_BACKLOG = 4096


@dataclass(frozen=True)
class Addresses:
    proxy: str
    admin: str | None


class ProxyService:
    def __init__(self, settings: Settings, exporters: list[Exporter] | None = None) -> None:
        if not settings.upstream:
            raise ValueError("at least one --upstream is required")
        self.settings = settings
        self.metrics = Metrics()
        self._inline: ExportRunner | None = None
        self.pool = UpstreamPool(settings.upstream)
        self.resolver = MetadataResolver([parse_mapping(rule) for rule in settings.map])
        self.pipeline = self._export_pipeline(exporters)
        self.assembler = Assembler(
            self.pipeline.submit,
            project=settings.project,
            experiment=settings.experiment,
            idle_timeout=settings.idle_timeout,
            step_close_grace=settings.step_close_grace or 0.0,
            defer_finishing=True,  # the capture stage emits closed trajectories in bursts
            on_close=lambda reason: self.metrics.trajectories_closed.labels(reason).inc(),
            inference=TrafficInference(on_evict=self.metrics.inference_evicted.inc),
            gate=SamplingGate(
                Sampler(
                    settings.sample_seed,
                    train=Policy(settings.max_samples_per_step, settings.sample_rate),
                    validate=Policy(
                        settings.validate_max_samples_per_step, settings.validate_sample_rate
                    ),
                ),
                self.pipeline.submit,
                on_drop=lambda what, why: self.metrics.sampler_dropped.labels(what, why).inc(),
                on_count=lambda what, outcome, n: self.metrics.sampled.labels(what, outcome).inc(n),
            ),
        )
        self.capture = CaptureStage(
            self.resolver,
            self.assembler,
            self.metrics,
            project=settings.project,
            experiment=settings.experiment,
            queue_size=settings.capture_queue,
            queue_bytes=settings.capture_queue_bytes,
            idle_check_interval=min(settings.idle_timeout / 4, 5.0),
        )
        self.tool_routes = {
            prefix: Upstream(url)
            for prefix, _, url in (route.partition("=") for route in settings.tool_route)
        }
        self.token2text: Token2Text | None = None  # inline exporting only
        self.tokenizer_discovery: asyncio.Future[None] | None = None  # once upstreams answered
        self._session: aiohttp.ClientSession | None = None
        self._client: UpstreamClient | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self.addresses: Addresses | None = None

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

    async def start(self) -> Addresses:
        """Raises TokenizerError (a configured tokenizer cannot be loaded), ConfigError (a
        backend cannot start, in the export process) or OSError (listen)."""
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
        self._client = UpstreamClient(settings.connect_timeout, settings.read_timeout)
        forwarder = Forwarder(
            self.pool,
            self._client,
            self.resolver,
            self.capture.submit,
            self.capture.admit,
            self.metrics,
            tool_routes=self.tool_routes,
        )
        if self.token2text is not None and self.token2text.tokenizers.empty:
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
        server = web.Server(
            forwarder.handle,
            handler_cancellation=True,  # a client that leaves cancels its upstream request
            auto_decompress=False,
            access_log=None,
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=settings.shutdown_grace)
        await self._runner.setup()
        site = web.TCPSite(self._runner, settings.host, settings.port, backlog=LISTEN_BACKLOG)
        await site.start()
        proxy_url = _bound_url(site)
        admin_url = None
        if settings.admin_port is not None:
            self._admin_runner = web.AppRunner(self._admin_app(), access_log=None)
            await self._admin_runner.setup()
            admin_site = web.TCPSite(self._admin_runner, settings.host, settings.admin_port)
            await admin_site.start()
            admin_url = _bound_url(admin_site)
        self.addresses = Addresses(proxy_url, admin_url)
        return self.addresses

    async def stop(self) -> None:
        if self.tokenizer_discovery is not None:
            self.tokenizer_discovery.cancel()
        if self._runner is not None:
            await self._runner.cleanup()  # stops accepting, then waits for in-flight requests
        await self.capture.stop()
        await self.pipeline.close(self.settings.shutdown_grace)
        if self._client is not None:
            await self._client.close()
        if self._session is not None:
            await self._session.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()

    async def __aenter__(self) -> ProxyService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _admin_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_endpoint)
        app.router.add_get("/health", self._health_endpoint)
        app.router.add_post("/rewards", self._rewards_endpoint)
        return app

    async def _rewards_endpoint(self, request: web.Request) -> web.Response:
        """Attach a reward, score or labels to a trajectory (see trajectories/rewards.py)."""
        token = self.settings.admin_token
        if token is not None and not hmac.compare_digest(
            request.headers.get("Authorization", ""), f"Bearer {token}"
        ):
            return web.json_response({"error": "a valid admin token is required"}, status=401)
        try:
            outcome = parse_outcome(orjson.loads(await request.read()))
        except orjson.JSONDecodeError as exc:
            return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
        except RewardError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        where = self.assembler.annotate(outcome)
        self.metrics.rewards.labels(where).inc()
        return web.json_response({"attached_to": where})

    async def _metrics_endpoint(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health_endpoint(self, request: web.Request) -> web.Response:
        status: dict[str, Any] = {
            "status": "ok",
            "upstreams": [{"url": u.base, "in_flight": u.in_flight} for u in self.pool.upstreams],
            "open_trajectories": self.assembler.open_count,
            "backends": self.pipeline.backends,
        }
        return web.json_response(status)


def _bound_url(site: web.TCPSite) -> str:
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    sock = server.sockets[0]  # type: ignore[attr-defined]
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}"
