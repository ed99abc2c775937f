"""A trace-proxy beside each of verl's rollout servers: one per node that hosts one, run by a Ray
actor scheduled on that node.

verl places each rollout server on the node of its first GPU worker; an agent-loop worker on
any node calls whichever server verl's load balancer picks. Each generate goes to the proxy on
the chosen server's node, which forwards it to that server only: a call crosses the network
exactly when verl's own Ray call would, and no process carries more than its node's traffic
(the driver and verl's TaskRunner carry none). One proxy per node rather than per server: a
proxy forwards thousands of calls a second on one core, more than a node's servers produce,
and each proxy costs two helper processes and a spool.

Each proxy writes its own replica directory, `<output>/replicas/<node>`, so several never
write one file; `trace-proxy show` and `trace-proxy ui` read the replicas of one output as one
store. A proxy that dies is started again on the same ports by its actor (and a dead actor by
Ray, on new ports, which the workers ask it for, and into a replica directory of its own
while the dead actor's proxy still drains into the first); meanwhile its calls take verl's own
path, counted. A proxy ends with its actor: stopped, or when the actor dies however it dies
(as when Ray ends the job: verl's trainer never stops anything), draining what it holds first
(launcher.py).
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_proxy.exporters.leftovers import SPOOL, idle
from trace_proxy.integrations.verl.launcher import (
    STOP_TIMEOUT_S,
    LaunchedProxy,
    ProxyStartError,
    launch,
    make_token,
    register_servers,
)
from trace_proxy.integrations.verl.link import Route

log = logging.getLogger(__name__)
REPLICAS = "replicas"  # <output>/replicas/<name>: one directory per proxy
RESTART_PAUSE_S = 1.0  # between attempts to start a dead proxy again


def _node_id(_: Any = None) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def server_nodes(llm_client: Any) -> dict[str, str]:
    """verl's rollout servers (`ip:port`) and the Ray node each runs on: asked of the server
    actors themselves when the load balancer hands out their handles, else found by address."""
    import ray

    balancer = llm_client._load_balancer
    servers: list[str] = list(ray.get(balancer.get_all_servers.remote()))
    try:
        handles: dict[str, Any] = ray.get(balancer.__ray_call__.remote(lambda b: dict(b._servers)))
    except Exception:  # a custom balancer without verl's handle table
        handles = {}
    by_address: dict[str, list[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            by_address.setdefault(node["NodeManagerAddress"], []).append(node["NodeID"])
    nodes: dict[str, str] = {}
    for server_id in servers:
        handle = handles.get(server_id)
        if handle is not None:
            nodes[server_id] = ray.get(handle.__ray_call__.remote(_node_id))
            continue
        found = by_address.get(_host(server_id), [])
        nodes[server_id] = found[0] if len(found) == 1 else _node_id()
    return nodes


def _host(server_id: str) -> str:
    """`ip:port` or `[v6]:port` without the port and brackets."""
    host = server_id.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


class NodeProxy:
    """The actor (one per node): runs `trace-proxy serve` there, listening on the address the
    node's rollout servers listen on, with those servers registered; starts it again on the
    same ports if it dies; stops it (drained) on `stop`, or with the actor's process."""

    def __init__(
        self, args: list[str], output: str, token: str, servers: list[str], timeout: float
    ) -> None:
        self._host = _host(servers[0])
        if not idle(Path(output) / SPOOL):  # a dead actor's proxy still draining into it
            output = f"{output}-{uuid.uuid4().hex[:6]}"
        self._output = output
        self._args = [*args, "--output", output, "--host", self._host]
        self._token = token
        self._servers = servers
        self._timeout = timeout
        self._stopping = threading.Event()
        self.restarts = 0
        self._proxy = self._start((0, 0))
        threading.Thread(target=self._watch, name="trace-proxy-watch", daemon=True).start()

    def _start(self, ports: tuple[int, int]) -> LaunchedProxy:
        proxy = launch(self._args, self._timeout, token=self._token, ports=ports)
        register_servers(proxy.admin_url, self._token, self._servers)
        return proxy

    def _watch(self) -> None:
        while True:
            proxy = self._proxy
            proxy.process.wait()
            proxy.process.release()
            if self._stopping.is_set():
                return
            ports = (_port(proxy.proxy_url), _port(proxy.admin_url))
            log.warning(
                "trace-proxy on %s exited: starting it again on the same ports; "
                "its calls take verl's own path meanwhile",
                self._host,
            )
            while not self._stopping.is_set():
                try:
                    self._proxy = self._start(ports)
                    self.restarts += 1
                    break
                except ProxyStartError as exc:
                    log.warning("trace-proxy on %s did not start again: %s", self._host, exc)
                    self._stopping.wait(RESTART_PAUSE_S)

    def addresses(self) -> tuple[str, str]:
        """Where the proxy listens: its URL and its admin port's."""
        return self._proxy.proxy_url, self._proxy.admin_url

    def status(self) -> dict[str, Any]:
        """For tests and operators: the proxy's process, where it writes, and how often it
        was started again."""
        return {"pid": self._proxy.process.pid, "restarts": self.restarts,
                "node_id": _node_id(), "proxy_url": self._proxy.proxy_url,
                "output": self._output}  # fmt: skip

    def stop(self) -> None:
        """SIGTERM to the proxy: it finishes what is in flight and writes every record."""
        self._stopping.set()
        self._proxy.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@dataclass
class ProxyFleet:
    """The node proxies of one trainer, started with its agent-loop manager. Each ends with
    its actor, drained, when Ray kills the job's actors; `stop` (also at the exit of a
    process that runs its exit handlers) ends them sooner."""

    actors: dict[str, Any]  # node id -> NodeProxy actor
    routes: dict[str, Route]  # server id -> the proxy of its node
    admin_token: str
    _stopped: bool = field(default=False, repr=False)

    @classmethod
    def start(cls, llm_client: Any, args: list[str], output: str, timeout: float) -> ProxyFleet:
        """A proxy on each node that hosts one of verl's servers, all ready, servers
        registered; ProxyStartError if one does not start within `timeout`."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = server_nodes(llm_client)
        if not nodes:
            raise ProxyStartError("verl's load balancer knows no rollout server")
        token = make_token()
        fleet_id = uuid.uuid4().hex[:8]
        actor_class = ray.remote(NodeProxy)
        actors: dict[str, Any] = {}
        for node_id in sorted(set(nodes.values())):
            servers = sorted(s for s, n in nodes.items() if n == node_id)
            name = _replica_name(_host(servers[0]), node_id, fleet_id)
            actors[node_id] = actor_class.options(
                num_cpus=0,
                max_restarts=-1,
                max_concurrency=4,  # `addresses` answers while `stop` drains
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                name=f"trace-proxy-{name}",
            ).remote(args, str(Path(output) / REPLICAS / name), token, servers, timeout)
        try:
            found = ray.get([a.addresses.remote() for a in actors.values()], timeout=timeout + 30)
        except Exception as exc:
            for actor in actors.values():
                ray.kill(actor)
            raise ProxyStartError(f"trace-proxy did not start on every node: {exc}") from None
        addresses: dict[str, tuple[str, str]] = dict(zip(actors, found, strict=True))
        routes = {
            server_id: Route(addresses[node_id][0], addresses[node_id][1], actors[node_id])
            for server_id, node_id in nodes.items()
        }
        fleet = cls(actors, routes, token)
        atexit.register(fleet.stop)
        return fleet

    @property
    def admin_urls(self) -> list[str]:
        return sorted({route.admin_url for route in self.routes.values()})

    @property
    def proxy_url(self) -> str:
        """The one proxy's URL, when there is one (a single node), for a client of its own."""
        (url,) = {route.proxy_url for route in self.routes.values()}
        return url

    @property
    def admin_url(self) -> str:
        (url,) = self.admin_urls
        return url

    def stop(self) -> None:
        """Every proxy drained and stopped; once."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        if not ray.is_initialized():  # Ray is gone: each proxy ended with its actor
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S + 30
        pending = [actor.stop.remote() for actor in self.actors.values()]
        for ref in pending:
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
            except Exception as exc:  # its actor is gone: its proxy ended with it
                log.warning("trace-proxy: a node proxy did not stop cleanly: %s", exc)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)


def _replica_name(host: str, node_id: str, fleet_id: str) -> str:
    """A directory name for one proxy's store: readable, and never another proxy's."""
    return f"{re.sub(r'[^A-Za-z0-9.-]', '_', host)}-{node_id[:8]}-{fleet_id}"
