"""The fixed set of upstreams: trajectory affinity, else the least loaded one.

All calls of one trajectory go to the upstream that served its first call, so the server's
prefix cache holds the growing context; new trajectories go where the fewest requests are in
flight. The set comes from configuration only: no request can add to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Upstream:
    base: str  # scheme://host:port[/base-path], no trailing slash
    in_flight: int = 0


class UpstreamPool:
    def __init__(self, urls: list[str], max_affinity: int = 200_000) -> None:
        if not urls:
            raise ValueError("at least one upstream is required")
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
