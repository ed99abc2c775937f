"""The upstreams a request may reach: the fixed set, and the set registered by the operator.

All calls of one trajectory go to the upstream that served its first call, so the server's
prefix cache holds the growing context; new trajectories go where the fewest requests are in
flight. The fixed set comes from configuration only. The registered set (`--register-upstreams`)
is changed only over the admin port, with its token: a request may name a registered upstream
by its id (`X-Trace-Proxy-Upstream`), which is looked up, never connected to as an address.
"""

from __future__ import annotations

import ipaddress
import re
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlsplit

from trace_proxy.options import plain_url

UPSTREAM_HEADER = "X-Trace-Proxy-Upstream"
MAX_REGISTERED = 4096
_ID = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9._:\[\]-]{0,127}")


@dataclass(eq=False)
class Upstream:
    base: str  # scheme://host:port[/base-path], no trailing slash
    in_flight: int = 0


class UpstreamPool:
    def __init__(self, urls: list[str], max_affinity: int = 200_000) -> None:
        """`urls` may be empty only when every request names a registered upstream."""
        self.upstreams = [Upstream(url) for url in urls]
        self._affinity: OrderedDict[str, Upstream] = OrderedDict()
        self._max_affinity = max_affinity
        self._next = 0

    @property
    def sticky(self) -> bool:
        """Affinity only matters when there is a choice."""
        return len(self.upstreams) > 1

    def acquire(self, affinity_key: str = "") -> Upstream:
        upstream = self._choose(affinity_key)
        upstream.in_flight += 1
        return upstream

    @staticmethod
    def release(upstream: Upstream) -> None:
        upstream.in_flight -= 1

    def _choose(self, affinity_key: str) -> Upstream:
        if not self.sticky:
            return self.upstreams[0]
        if affinity_key:
            known = self._affinity.get(affinity_key)
            if known is not None:
                self._affinity.move_to_end(affinity_key)
                return known
        # Least in flight; ties broken round-robin so idle upstreams share new work.
        count = len(self.upstreams)
        start = self._next
        self._next = (self._next + 1) % count
        best = min(
            (self.upstreams[(start + i) % count] for i in range(count)),
            key=lambda u: u.in_flight,
        )
        if affinity_key:
            self._affinity[affinity_key] = best
            if len(self._affinity) > self._max_affinity:
                self._affinity.popitem(last=False)
        return best


class RegistrationError(ValueError):
    """A registration the proxy refuses; the message says what to fix."""


def registered_url(value: object) -> str:
    """`http://IP:PORT[/path]`: an IP literal, so that what was registered is what is
    connected to (a host name could resolve elsewhere later)."""
    if not isinstance(value, str):
        raise RegistrationError("'url' must be a string")
    try:
        url = plain_url(value)
    except ValueError as exc:
        raise RegistrationError(str(exc)) from None
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise RegistrationError("credentials do not belong in an upstream URL")
    try:
        ipaddress.ip_address(parts.hostname or "")
        port = parts.port
    except ValueError:
        raise RegistrationError(
            f"{value!r}: the host must be an IP address and the port a number"
        ) from None
    if port is None or port == 0:
        raise RegistrationError(f"{value!r}: the port must be given")
    return url


class RegisteredUpstreams:
    """Upstreams the operator (or a trainer holding the admin token) registered by id."""

    def __init__(self, limit: int = MAX_REGISTERED) -> None:
        self._by_id: dict[str, Upstream] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._by_id)

    def register(self, upstream_id: str, url: object) -> Upstream:
        """Add or move one upstream; a re-registration keeps its in-flight count when the
        URL is the same."""
        if not _ID.fullmatch(upstream_id):
            raise RegistrationError(
                f"{upstream_id[:140]!r} is not an upstream id (1-128 letters, digits, "
                "'.', '_', ':', '[', ']' or '-')"
            )
        base = registered_url(url)
        known = self._by_id.get(upstream_id)
        if known is not None and known.base == base:
            return known
        if known is None and len(self._by_id) >= self._limit:
            raise RegistrationError(f"at most {self._limit} upstreams can be registered")
        upstream = Upstream(base)
        self._by_id[upstream_id] = upstream
        return upstream

    def remove(self, upstream_id: str) -> bool:
        return self._by_id.pop(upstream_id, None) is not None

    def get(self, upstream_id: str) -> Upstream | None:
        """The upstream registered under this id, or None: a request's value is a name
        looked up here, nothing more."""
        return self._by_id.get(upstream_id)

    def listing(self) -> dict[str, str]:
        return {upstream_id: u.base for upstream_id, u in self._by_id.items()}
