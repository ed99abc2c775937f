"""Custody of exchanges in the capture process, so that when it is killed the proxy counts
exactly what was lost with it: nothing twice, nothing it had already written.

The forwarder knows how many exchanges it wrote to the capture process (`Custody.sent`); the
capture process knows where each went (`Ledger`). An exchange is one unit when it arrives;
parsing turns it into as many units as it made calls, tool calls or step events (a batched
prompt: several; a route with nothing to record: none). A unit then waits in an open
trajectory, in a trajectory held until its step ends, or in the memory queue before the spool,
until it is written to the spool or dropped and counted (settled).

Right before the spool writer writes a batch, the capture process tells the forwarder how many
units each record of the batch holds (`spooling`), with its ledger; its status says how far the
spool is written. When it dies, its successor opens the spool and says where it ends (a torn
tail cut off): the announced records before that end were written. What was sent and is
neither settled nor written is lost, and counted once (`capture_process_lost`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Ledger:
    """The capture process's side: units made, units settled, units held by each record on
    its way to the spool."""

    __slots__ = ("_held", "expanded", "settled")

    def __init__(self) -> None:
        self.expanded = 0  # units made minus exchanges parsed
        self.settled = 0  # units dropped and counted, or with nothing to record
        self._held: dict[int, tuple[object, int]] = {}  # by id(): the record itself, its units

    def made(self, units: int) -> None:
        """An exchange was parsed into `units` units."""
        self.expanded += units - 1

    def settle(self, units: int = 1) -> None:
        self.settled += units

    def hold(self, record: object, units: int) -> None:
        """`record` carries `units` from here to the spool (kept referenced, so its id stays
        its own until taken)."""
        if units:
            self._held[id(record)] = (record, units)

    def settle_record(self, record: object) -> None:
        """`record` was dropped (and counted) before the spool."""
        found = self._held.pop(id(record), None)
        if found is not None:
            self.settled += found[1]

    def take(self, records: Iterable[object]) -> list[int]:
        """The units of each record about to be written."""
        held = self._held
        return [held.pop(id(record), (None, 0))[1] for record in records]

    def snapshot(self) -> dict[str, int]:
        return {"expanded": self.expanded, "settled": self.settled}


@dataclass
class Unsettled:
    """What a dead capture process held: settled once its successor says where the spool
    ends."""

    held: int  # units sent and neither settled nor known to be written
    announced: dict[int, int]  # seq → units, announced but not known to be written

    def lost(self, spool_end: int | None) -> int:
        """`spool_end` None: where the spool ends is not known (counted as not written)."""
        if spool_end is None:
            return self.held
        return self.held - sum(u for seq, u in self.announced.items() if seq < spool_end)


@dataclass
class Custody:
    """The forwarder's side, for the current capture process."""

    sent: int = 0  # exchanges written to it
    expanded: int = 0  # as its ledger last said
    settled: int = 0
    spooled: int = 0  # units in records known to be written
    announced: dict[int, int] = field(default_factory=dict)  # seq → units, not yet known

    def update(self, ledger: dict[str, Any]) -> None:
        self.expanded = ledger["expanded"]
        self.settled = ledger["settled"]

    def spooling(self, first: int, units: list[int]) -> None:
        for offset, count in enumerate(units):
            if count:
                self.announced[first + offset] = count

    def written(self, end: int) -> None:
        """The spool is written up to `end` (exclusive)."""
        done = [seq for seq in self.announced if seq < end]
        for seq in done:
            self.spooled += self.announced.pop(seq)

    def unsettled(self) -> Unsettled:
        held = self.sent + self.expanded - self.settled - self.spooled
        return Unsettled(held, dict(self.announced))
