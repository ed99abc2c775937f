"""One running proxy, with an explicit lifecycle: start, serve, stop (drain, then flush).

The listener is aiohttp's low-level `web.Server` (no router, no middlewares: every request goes
to the forwarder). Starting listens at once: the helper processes are spawned first (what is
forwarded meanwhile waits for them in their socket, or in the spool) and start in the
background; `/ready` on the admin port says what is still starting, and `failure` is set when
something cannot start as configured (a tokenizer, a backend, a spool another proxy holds).
What can be told in milliseconds is checked before listening. Stopping follows the order that
keeps every record: stop accepting, let in-flight requests finish within the grace period
(the exporters drain at full priority meanwhile), parse what was captured, close every open
trajectory, export or count everything, then close the upstream connections.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.config import ConfigError, Settings
from trace_proxy.exporters.base import Exporter
from trace_proxy.exporters.spool import SpoolBusy, check_not_in_use
from trace_proxy.metrics import Metrics, exposition
from trace_proxy.processes.capture import CaptureProcess
from trace_proxy.processes.recorder import Recorder
from trace_proxy.proxy.forward import Forwarder
from trace_proxy.proxy.limits import ClientLimits, LimitedAppRunner, LimitedServer, Rejections
from trace_proxy.proxy.upstream_client import UpstreamClient
from trace_proxy.proxy.upstreams import (
    RegisteredUpstreams,
    RegistrationError,
    Upstream,
    UpstreamPool,
)
from trace_proxy.text.token2text import check_configured
from trace_proxy.trajectories.rewards import RewardError, parse_outcome
from trace_proxy.trajectories.sampler import DecisionError, parse_decision

log = logging.getLogger(__name__)
_Parsed = TypeVar("_Parsed")
# Thousands of rollout workers may connect at once; the kernel caps this at somaxconn.
LISTEN_BACKLOG = 4096


@dataclass(frozen=True)
class Addresses:
    proxy: str
    admin: str | None


class ProxyService:
    def __init__(self, settings: Settings, exporters: list[Exporter] | None = None) -> None:
        """Exporter objects (tests, embedding) run inline, and so does capture then."""
        if not settings.upstream and not settings.register_upstreams:
            raise ValueError("at least one --upstream is required (or --register-upstreams)")
        self.settings = settings
        self.metrics = Metrics()
        self.pool = UpstreamPool(settings.upstream)
        self.registered = RegisteredUpstreams() if settings.register_upstreams else None
        self.resolver = MetadataResolver.of(settings.map)  # the forwarder's and capture's
        self.recorder: Recorder | CaptureProcess
        if exporters is None and settings.capture_mode == "process":
            self.recorder = CaptureProcess(settings, self.metrics, self.resolver)
        else:
            self.recorder = Recorder(settings, self.metrics, exporters, resolver=self.resolver)
        self.tool_routes = {
            prefix: Upstream(url)
            for prefix, _, url in (route.partition("=") for route in settings.tool_route)
        }
        self._client: UpstreamClient | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self.addresses: Addresses | None = None
        self._listening = self._stopping = False
        self._changed = asyncio.Event()
        self.recorder.on_change = self._changed.set
        self.backlog: dict[str, int] | None = None  # per backend, once stopped

    @property
    def inline(self) -> Recorder:
        """The recorder, when it runs in this process (`--capture-mode inline`, or exporter
        objects given): its capture stage, assembler and pipeline can be reached directly."""
        if not isinstance(self.recorder, Recorder):
            raise RuntimeError("capture runs in its own process (--capture-mode process)")
        return self.recorder

    @property
    def tokenizer_discovery(self) -> asyncio.Future[None] | None:
        """Done once token2text has found the served models' tokenizers (or given up)."""
        return self.recorder.tokenizer_discovery

    @property
    def _capture_budget(self) -> int:
        """Body bytes an exchange can ever be queued with: the forwarder's half of
        --capture-queue-bytes with a capture process, all of it inline."""
        budget = self.settings.capture_queue_bytes
        return budget // 2 if isinstance(self.recorder, CaptureProcess) else budget

    @property
    def failure(self) -> asyncio.Future[BaseException] | None:
        """Done, with the error, when something cannot start as configured (the command
        line ends on it); made by `start`."""
        return self.recorder.failure

    async def flush(self) -> None:
        """Wait until every exchange forwarded so far is parsed, and every trajectory it
        closed is exported by every backend (or counted)."""
        await self.recorder.flush()

    def readiness(self) -> dict[str, str]:
        """Each check of /ready: "ok", or what it is doing (starting, waiting, failed)."""
        listening = "ok" if self._listening else "no"
        checks = {"listening": "stopping" if self._stopping else listening}
        if isinstance(self.recorder, CaptureProcess):
            checks.update(self.recorder.checks())
        else:
            checks["capture"] = "ok"
            checks.update(self.recorder.checks())
        return checks

    async def wait_ready(self) -> None:
        """Until every check passes; raises the error when something cannot start."""
        failure = self.failure
        assert failure is not None, "start() first"
        while True:
            if failure.done():
                raise failure.result()
            if all(value == "ok" for value in self.readiness().values()):
                return
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            waits: list[asyncio.Future[Any]] = [changed, failure]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()

    def _check(self) -> None:
        """What can be told before listening, in milliseconds. Raises TokenizerError (a
        --tokenizer path that does not exist, transformers missing) or ConfigError (the
        spool directory cannot be made, or another running proxy holds it)."""
        settings = self.settings
        if settings.uses_tokenizers:
            check_configured(settings.tokenizer)
        spool_dir = settings.spool_path
        try:
            spool_dir.mkdir(parents=True, exist_ok=True)
            check_not_in_use(spool_dir, os.getpid())
        except SpoolBusy as exc:
            raise ConfigError(str(exc)) from None
        except OSError as exc:
            raise ConfigError(f"invalid value for --spool-dir: {exc}") from None

    async def start(self) -> Addresses:
        """Listen; the helper processes start in the background (`readiness`, `wait_ready`,
        `failure`). Raises TokenizerError or ConfigError for what can be told at once (see
        `_check`), OSError when a port cannot be listened on."""
        settings = self.settings
        self._check()
        self._client = UpstreamClient(settings.connect_timeout, settings.read_timeout)
        forwarder = Forwarder(
            self.pool,
            self._client,
            self.resolver,
            self.recorder.submit,
            self.recorder.admit,
            self.metrics,
            tool_routes=self.tool_routes,
            capture_max_body=min(settings.capture_max_body, self._capture_budget),
            registered=self.registered,
        )
        await self.recorder.start()
        limits = ClientLimits.of(settings)
        server = LimitedServer(
            forwarder.handle,
            limits,
            Rejections(self.metrics.client_rejected),
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
            self._admin_runner = LimitedAppRunner(
                self._admin_app(),
                limits,
                Rejections(self.metrics.admin_rejected, "the admin port"),
                access_log=None,
            )
            await self._admin_runner.setup()
            admin_site = web.TCPSite(self._admin_runner, settings.host, settings.admin_port)
            await admin_site.start()
            admin_url = _bound_url(admin_site)
            if settings.admin_token is None and not _loopback_only(admin_site):
                log.warning(
                    "the admin port %s listens beyond loopback without --admin-token: anyone "
                    "who can reach it can post rewards and labels to any trajectory",
                    admin_url,
                )
        self.addresses = Addresses(proxy_url, admin_url)
        self._listening = True
        self._changed.set()
        return self.addresses

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests, then record and export what is held;
        `backlog` then says how many records each backend still has in the spool."""
        self._stopping = True
        self._changed.set()
        if self.recorder.failure is not None:
            self.recorder.hurry()  # the exporters drain at full priority from now on
        if self._runner is not None:
            await self._runner.cleanup()  # stops accepting, then waits for in-flight requests
        if self.recorder.failure is not None:
            await self.recorder.stop(self.settings.shutdown_grace)
        self.backlog = (
            self.recorder.backlog
            if isinstance(self.recorder, CaptureProcess)
            else self.recorder.pipeline.backlog
        )
        if self._client is not None:
            await self._client.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()

    async def __aenter__(self) -> ProxyService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _admin_app(self) -> web.Application:
        """Reading routes are open (a Prometheus scraper has no token); every other method,
        on any path, needs the token when one is set, so a route added later cannot forget."""
        app = web.Application(middlewares=[_token_required(self.settings.admin_token)])
        app.router.add_get("/metrics", self._metrics_endpoint)
        app.router.add_get("/health", self._health_endpoint)
        app.router.add_get("/ready", self._ready_endpoint)
        app.router.add_post("/rewards", self._rewards_endpoint)
        app.router.add_post("/sampling", self._sampling_endpoint)
        app.router.add_get("/upstreams", self._upstreams_endpoint)
        app.router.add_put("/upstreams/{id}", self._register_endpoint)
        app.router.add_delete("/upstreams/{id}", self._unregister_endpoint)
        return app

    def _registration(self) -> RegisteredUpstreams:
        if self.registered is None:
            raise web.HTTPForbidden(
                body=orjson.dumps({"error": "this proxy was started without --register-upstreams"}),
                content_type="application/json",
            )
        return self.registered

    async def _upstreams_endpoint(self, request: web.Request) -> web.Response:
        """The fixed upstreams and the registered ones, by id."""
        registered = self.registered.listing() if self.registered is not None else None
        body = {"fixed": [u.base for u in self.pool.upstreams], "registered": registered}
        return web.json_response(body)

    async def _register_endpoint(self, request: web.Request) -> web.Response:
        """Register (or move) one upstream: `{"url": "http://IP:PORT"}`; needs the token."""
        registered = self._registration()
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise RegistrationError("the body must be a JSON object with 'url'")
            upstream = registered.register(request.match_info["id"], body.get("url"))
        except orjson.JSONDecodeError as exc:
            return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
        except RegistrationError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        log.info("registered upstream %s -> %s", request.match_info["id"], upstream.base)
        return web.json_response({"id": request.match_info["id"], "url": upstream.base})

    async def _unregister_endpoint(self, request: web.Request) -> web.Response:
        removed = self._registration().remove(request.match_info["id"])
        return web.json_response({"removed": removed}, status=200 if removed else 404)

    async def _rewards_endpoint(self, request: web.Request) -> web.Response:
        """Attach a reward, score or labels to a trajectory (see trajectories/rewards.py)."""
        outcome = await _json_body(request, _checked_outcome, RewardError)
        try:
            where = await self.recorder.annotate(outcome)
        except RuntimeError as exc:  # the capture process is restarting
            return web.json_response({"error": str(exc)}, status=503)
        return web.json_response({"attached_to": where})

    async def _sampling_endpoint(self, request: web.Request) -> web.Response:
        """The kept samples of one step, decided by whoever saw its whole batch (verl's
        agent-loop manager): `{"experiment", "step", "validate", "kept": [...]}`."""
        decision = await _json_body(request, parse_decision, DecisionError)
        try:
            given = await self.recorder.give_samples(decision)
        except RuntimeError as exc:  # the capture process is restarting
            return web.json_response({"error": str(exc)}, status=503)
        if not given:
            kind = "validation" if decision.validate else "training"
            return web.json_response({"error": f"this proxy keeps no number of samples per "
                                      f"{kind} step (--max-samples-per-step, "
                                      "--validate-max-samples-per-step): nothing to decide"},
                                     status=409)  # fmt: skip
        return web.json_response({"kept": len(decision.kept)})

    async def _metrics_endpoint(self, request: web.Request) -> web.Response:
        body = exposition(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _ready_endpoint(self, request: web.Request) -> web.Response:
        """200 when every check passes, else 503; the same body names each check."""
        checks = self.readiness()
        waiting = [name for name, value in checks.items() if value != "ok"]
        body = {"status": "not ready" if waiting else "ready", "checks": checks,
                "not_ready": waiting}  # fmt: skip
        return web.json_response(body, status=503 if waiting else 200)

    async def _health_endpoint(self, request: web.Request) -> web.Response:
        """Alive: answered while the event loop runs, whatever is still starting."""
        status: dict[str, Any] = {
            "status": "ok",
            "upstreams": [{"url": u.base, "in_flight": u.in_flight} for u in self.pool.upstreams],
            "registered_upstreams": len(self.registered) if self.registered is not None else None,
            "open_trajectories": self.recorder.open_count,
            "backends": self.recorder.backends,
        }
        return web.json_response(status)


async def _json_body(
    request: web.Request, parse: Callable[[Any], _Parsed], error: type[Exception]
) -> _Parsed:
    """The request's JSON body, as `parse` reads it; a 400 naming what is wrong if not."""
    try:
        return parse(orjson.loads(await request.read()))
    except orjson.JSONDecodeError as exc:
        message = f"the body is not JSON: {exc}"
    except error as exc:
        message = str(exc)
    raise web.HTTPBadRequest(text=orjson.dumps({"error": message}).decode(),
                             content_type="application/json")  # fmt: skip


def _checked_outcome(body: Any) -> Any:
    """The body as sent, once it reads as an outcome (the recorder parses it again)."""
    parse_outcome(body)
    return body


READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _token_required(token: str | None) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            token is not None
            and request.method not in READ_ONLY_METHODS
            and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"),
                expected,
            )
        ):
            return web.json_response({"error": "a valid admin token is required"}, status=401)
        return await handler(request)

    return require_token


def _loopback_only(site: web.TCPSite) -> bool:
    """Whether every address the site listens on is a loopback address."""
    server = site._server
    assert server is not None
    for sock in server.sockets:  # type: ignore[attr-defined]
        host = sock.getsockname()[0].partition("%")[0]  # an IPv6 scope id is not an address
        if not ipaddress.ip_address(host).is_loopback:
            return False
    return True


def _bound_url(site: web.TCPSite) -> str:
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    sock = server.sockets[0]  # type: ignore[attr-defined]
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}"
