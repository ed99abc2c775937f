"""The engine every route runs through: pacing, pause/resume, aborts, weight versions.

RL trainers pause generation, push weights and resume while requests are in flight; one engine
per server keeps those states in one place, so every route (vLLM's and SGLang's) sees the same
pauses, aborts and weight-version spans.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .wire import JSON

PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."


class Paused(Exception):
    """The engine rejects new requests while paused (vLLM `abort`/`wait` pause modes)."""


@dataclass(eq=False)
class Flight:
    """One in-flight request: its ids (for aborts) and the weight version of each step."""

    ids: tuple[str, ...]
    aborted: bool = False
    steps: int = 0
    version_starts: list[tuple[str, int]] = field(default_factory=list)

    def weight_versions(self, num_tokens: int) -> list[JSON]:
        """`[{"version","start","end"}]` spans over the first `num_tokens` output tokens."""
        starts = [(v, s) for v, s in self.version_starts if s < num_tokens or s == 0]
        ends = [s for _, s in starts[1:]] + [num_tokens]
        return [
            {"version": v, "start": s, "end": e} for (v, s), e in zip(starts, ends, strict=True)
        ]


class Engine:
    """Pacing, pause/resume, aborts and the weight version, shared by every route."""

    def __init__(self, token_delay: float = 0.0) -> None:
        self.token_delay = token_delay
        self.weight_version = "default"
        self.paused = False
        self.reject_new = False
        self.flights: set[Flight] = set()
        self._running = asyncio.Event()
        self._running.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()  # replaced and set on every resume/abort
        self._admitted = asyncio.Event()  # replaced and set on every admission

    def admit(self, ids: Iterable[str]) -> Flight:
        if self.reject_new:
            raise Paused(PAUSED_MESSAGE)
        flight = Flight(tuple(ids))
        self.flights.add(flight)
        self._idle.clear()
        admitted, self._admitted = self._admitted, asyncio.Event()
        admitted.set()
        return flight

    async def wait_in_flight(self, count: int = 1, timeout: float = 5.0) -> None:
        """Wait until at least `count` requests are generating (a test's sync point)."""

        async def reached() -> None:
            while len(self.flights) < count:
                await self._admitted.wait()

        await asyncio.wait_for(reached(), timeout)

    def release(self, flight: Flight) -> None:
        self.flights.discard(flight)
        if not self.flights:
            self._idle.set()

    async def tick(self, flight: Flight) -> bool:
        """Wait for the next token step; False once the request was aborted."""
        # Without a delay, still yield every few tokens so one stream cannot hog the loop.
        if self.token_delay > 0 or flight.steps % 8 == 0:
            await asyncio.sleep(self.token_delay)
        while not self._running.is_set() and not flight.aborted:
            await self._wake.wait()
        if flight.aborted:
            return False
        self._record_step(flight, 1)
        return True

    async def run(self, flight: Flight, steps: int) -> int:
        """Pace a non-streaming request through `steps` token steps; returns the steps done."""
        if self.token_delay <= 0 and self._running.is_set() and not flight.aborted:
            self._record_step(flight, steps)  # nothing to wait for: skip the per-token loop
            return steps
        done = 0
        while done < steps and await self.tick(flight):
            done += 1
        return done

    def _record_step(self, flight: Flight, steps: int) -> None:
        version = self.weight_version
        if not flight.version_starts or flight.version_starts[-1][0] != version:
            flight.version_starts.append((version, flight.steps))
        flight.steps += steps

    def abort(self, match: Callable[[str], bool] | None = None) -> int:
        """Abort in-flight requests with an id `match` accepts (all when None)."""
        hits = [f for f in self.flights if match is None or any(map(match, f.ids))]
        for flight in hits:
            flight.aborted = True
        self._notify()
        return len(hits)

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def pause(self, *, hold: bool, reject_new: bool, abort: bool) -> None:
        self.paused = True
        self.reject_new = reject_new
        if hold:
            self._running.clear()
        if abort:
            self.abort()

    def resume(self) -> None:
        self.paused = False
        self.reject_new = False
        self._running.set()
        self._notify()

    async def drained(self) -> None:
        await self._idle.wait()
