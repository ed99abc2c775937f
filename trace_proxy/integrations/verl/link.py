"""The agent-loop side's connection to trace-proxy: generate over HTTP, register upstreams,
close trajectories; and the fallback accounting when a proxy cannot be used.

A `ProxyLink` travels to verl's agent-loop workers pickled inside verl's LLM client (never in
verl's config, which verl logs to its trackers): it holds the admin token. Each worker process
opens its own HTTP session on first use. With a proxy per node (`fleet.py`) it holds a route
per rollout server: the proxy on that server's node. A proxy found unreachable is tried again
after RETRY_AFTER_S (and, when it runs as a Ray actor, asked for its addresses again: a
restarted actor listens elsewhere); meanwhile the calls it would carry take verl's own path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from trace_proxy.integrations.verl.admission import GateReads
from trace_proxy.integrations.verl.mapping import (
    GenerateResult,
    ServerLimits,
    UnexpectedAnswer,
    sglang_request,
    sglang_result,
    vllm_request,
    vllm_result,
)
from trace_proxy.proxy.upstreams import UPSTREAM_HEADER
from trace_proxy.trajectories.keys import WEIGHT_VERSION_HEADER

log = logging.getLogger(__name__)
RETRY_AFTER_S = 30.0  # a proxy found unreachable is tried again after this long


class ProxyUnreachable(ConnectionError):
    """The proxy could not be reached, or refused to forward (421)."""


class ServerUnreachable(ConnectionError):
    """The proxy could not reach verl's server (502/504 from the proxy itself)."""


@dataclass(frozen=True)
class Route:
    """Where calls to one rollout server go: the proxy beside it, and that proxy's admin port.
    `actor`: the Ray actor that runs the proxy (asked for its addresses after a failure)."""

    proxy_url: str
    admin_url: str
    actor: Any = None


@dataclass(frozen=True)
class TrajectoryTags:
    """What the proxy records of one agent-loop run (sent as X-Rollout-* headers)."""

    project: str
    experiment: str
    step: int
    sample_index: int
    rollout_n: int
    validate: bool
    trajectory_id: str
    sample_id: str | None = None  # verl's `uid` of the sample, when its batch has one

    def headers(self) -> dict[str, str]:
        found = {
            "X-Rollout-Project": self.project,
            "X-Rollout-Experiment": self.experiment,
            "X-Rollout-Step": str(self.step),
            "X-Rollout-Sample-Index": str(self.sample_index),
            "X-Rollout-N": str(self.rollout_n),
            "X-Rollout-Validate": "true" if self.validate else "false",
            "X-Rollout-Trajectory-Id": self.trajectory_id,
        }
        if self.sample_id is not None:
            found["X-Rollout-Sample-Id"] = self.sample_id
        return found


@dataclass
class ProxyLink:
    """`proxy_url`/`admin_url`: the proxy for servers without a route of their own (one proxy
    for all, or a sidecar); None with a proxy per node, where `routes` names each server's."""

    proxy_url: str | None
    admin_url: str | None
    admin_token: str | None
    limits: ServerLimits
    routes: dict[str, Route] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = field(default=None, repr=False)
    _registered: dict[tuple[str, str], asyncio.Future[None]] = field(
        default_factory=dict, repr=False
    )
    _down: dict[str, float] = field(default_factory=dict, repr=False)  # proxy URL -> until
    _refreshing: set[str] = field(default_factory=set, repr=False)
    fallbacks: Counter[str] = field(default_factory=Counter, repr=False)
    gates: GateReads = field(default_factory=GateReads, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        """What a worker gets: the addresses, the token and the limits, no live state."""
        return {"proxy_url": self.proxy_url, "admin_url": self.admin_url,
                "admin_token": self.admin_token, "limits": self.limits,
                "routes": self.routes}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:  # never the token
        where = self.proxy_url or f"{len({r.proxy_url for r in self.routes.values()})} proxies"
        return f"ProxyLink({where}, admin {self.admin_url})"

    def route(self, server_id: str) -> Route | None:
        """The proxy for calls to `server_id`, or None when no proxy is known for it."""
        found = self.routes.get(server_id)
        if found is not None:
            return found
        if self.proxy_url is None or self.admin_url is None:
            return None
        return Route(self.proxy_url, self.admin_url)

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    def usable(self, route: Route) -> bool:
        """Not found unreachable in the last RETRY_AFTER_S."""
        return asyncio.get_running_loop().time() >= self._down.get(route.proxy_url, 0.0)

    def fell_back(self, reason: str, detail: str = "") -> None:
        """Counted each time; logged the first time per reason in this process."""
        self.fallbacks[reason] += 1
        if self.fallbacks[reason] == 1:
            log.warning(
                "trace-proxy: a generate call took verl's own path (%s%s); this is logged "
                "once per reason and worker, and counted (not traced)",
                reason,
                f": {detail}" if detail else "",
            )

    def mark_down(self, error: BaseException, route: Route) -> None:
        """`route`'s proxy cannot be used: its calls take verl's path for RETRY_AFTER_S, and
        what it had registered is registered again when it is back (it may have restarted)."""
        self._down[route.proxy_url] = asyncio.get_running_loop().time() + RETRY_AFTER_S
        for key in [key for key in self._registered if key[0] == route.admin_url]:
            self._registered.pop(key)
        self.fell_back("proxy_unreachable", f"{type(error).__name__}: {error}")
        if route.actor is not None and route.proxy_url not in self._refreshing:
            self._refreshing.add(route.proxy_url)
            task = asyncio.ensure_future(self._refresh(route))
            task.add_done_callback(lambda _: self._refreshing.discard(route.proxy_url))

    async def _refresh(self, route: Route) -> None:
        """Ask the proxy's actor where it listens now (Ray restarts a dead actor, whose proxy
        then listens on other ports); the servers it serves move there, usable at once."""
        try:
            proxy_url, admin_url = await asyncio.wait_for(route.actor.addresses.remote(), 60)
        except Exception:  # still restarting, or gone: the route stays down, tried later
            return
        if proxy_url == route.proxy_url:
            return
        moved = Route(proxy_url, admin_url, route.actor)
        for server_id, known in list(self.routes.items()):
            if known.proxy_url == route.proxy_url:
                self.routes[server_id] = moved

    async def register(self, server_id: str, route: Route) -> None:
        """Make verl's server reachable through `route`'s proxy under its own id (its
        address); once per server, proxy and worker, however many calls ask at once."""
        key = (route.admin_url, server_id)
        known = self._registered.get(key)
        if known is None:
            known = asyncio.ensure_future(self._register(server_id, route))
            self._registered[key] = known
        try:
            await asyncio.shield(known)
        except BaseException:
            if known.done():
                self._registered.pop(key, None)  # tried again by the next call
            raise

    async def _register(self, server_id: str, route: Route) -> None:
        url = f"{route.admin_url}/upstreams/{server_id}"
        try:
            async with self._open().put(
                url, json={"url": f"http://{server_id}"}, headers=self._admin_headers()
            ) as response:
                if response.status != 200:
                    raise ProxyUnreachable(
                        f"registering {server_id}: {response.status} {await response.text()}"
                    )
        except aiohttp.ClientError as exc:
            raise ProxyUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def generate(
        self,
        server_id: str,
        tags: TrajectoryTags,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        request_id: str,
        priority: int = 0,
        route: Route | None = None,
        weight_version: Any = None,
    ) -> GenerateResult:
        """One generate through `route`'s proxy (else the server's) to `server_id`;
        `weight_version`, the policy version that generates it, is recorded with it.
        ProxyUnreachable when the proxy is the problem (verl's own path then runs); a
        server's own error is raised as verl's path would raise it (RuntimeError with the
        server's message)."""
        route = route or self.route(server_id)
        if route is None:
            raise ProxyUnreachable(f"no proxy is known for verl's server {server_id}")
        await self.register(server_id, route)
        limits = self.limits
        if limits.engine == "vllm":
            body = vllm_request(
                prompt_ids, sampling_params, limits, request_id=request_id, priority=priority
            )
            path = "/v1/completions"
        else:
            body = sglang_request(prompt_ids, sampling_params, limits, request_id=request_id)
            path = "/generate"
        headers = {**tags.headers(), UPSTREAM_HEADER: server_id,
                   "Content-Type": "application/json"}  # fmt: skip
        if weight_version is not None:
            headers[WEIGHT_VERSION_HEADER] = str(weight_version)
        try:
            async with self._open().post(
                route.proxy_url + path, data=orjson.dumps(body), headers=headers
            ) as response:
                payload = await response.read()
                status = response.status
        except aiohttp.ClientError as exc:
            raise ProxyUnreachable(f"{type(exc).__name__}: {exc}") from exc
        try:
            answer = orjson.loads(payload)
        except orjson.JSONDecodeError:
            answer = None
        error = answer.get("error") if isinstance(answer, dict) else None
        if status == 421:  # not registered there (a restarted proxy): registered again next
            self._registered.pop((route.admin_url, server_id), None)
            raise ProxyUnreachable(f"{status}: {error}")
        if isinstance(error, dict) and str(error.get("type", "")).startswith("upstream_"):
            raise ServerUnreachable(f"{status}: {error.get('message')}")
        if status != 200 or answer is None:
            raise RuntimeError(f"{server_id} answered {status}: {payload[:2000]!r}")
        try:
            if limits.engine == "vllm":
                return vllm_result(answer)
            return sglang_result(answer, bool(body["return_logprob"]))
        except UnexpectedAnswer as exc:
            raise RuntimeError(f"{server_id}: {exc}") from None

    async def end_trajectory(
        self, tags: TrajectoryTags, reward: float | None, admin_urls: Iterable[str] = ()
    ) -> None:
        """Close the trajectory now, with verl's reward when it has one, on every proxy its
        calls went through (`admin_urls`; else the link's own). Never raises: a trajectory
        not closed here closes when idle or when its step ends."""
        # The whole key: a reward for a sample the sampler dropped is filed under its run.
        body: dict[str, Any] = {
            "trajectory_id": tags.trajectory_id,
            "project": tags.project,
            "experiment": tags.experiment,
            "step": tags.step,
            "validate": tags.validate,
            "done": True,
        }
        if reward is not None:
            body["reward"] = float(reward)
        targets = list(admin_urls) or ([self.admin_url] if self.admin_url else [])
        for admin_url in targets:
            try:
                async with self._open().post(
                    f"{admin_url}/rewards", json=body, headers=self._admin_headers()
                ) as response:
                    if response.status != 200:
                        text = await response.text()
                        self.fell_back("close_refused", f"{response.status} {text}")
            except (aiohttp.ClientError, OSError) as exc:
                self.fell_back("close_unreachable", f"{type(exc).__name__}: {exc}")
