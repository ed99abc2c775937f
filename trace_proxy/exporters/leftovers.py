"""Records a killed proxy left in its spool, not yet in its store.

A proxy killed with every one of its processes at once (its whole session SIGKILLed: nothing
could finish) leaves in its spool the records its jsonl backend had not written yet. A proxy
started again on the same output exports them; when none will be (a run that is over: verl's
proxies each write a replica directory of their own), `trace-proxy recover` does. `show`, `ui`
and `export` name each such spool, so nothing is lost silently.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from trace_proxy.exporters.spool import SpoolReader, cursors
from trace_proxy.store.replicas import store_roots

SPOOL = ".spool"  # a store's spool, as `serve` places it without --spool-dir
STORE_BACKEND = "jsonl"
WRITER = "writer"  # the spool's lock its writer holds (exporters/spool.py)


@dataclass(frozen=True)
class Leftover:
    store: Path  # where the records belong
    spool: Path
    records: int  # not yet in the store


def spool_records_after(spool: Path, start: int) -> int:
    """How many records the spool holds from sequence number `start` on."""
    reader = SpoolReader(spool)
    count = 0
    try:
        while True:
            batch = reader.read(start, 4096)
            if not batch.records:
                return count
            count += len(batch.records)
            start = batch.next
    finally:
        reader.close()


def idle(spool: Path) -> bool:
    """No process writes this spool now (a proxy, or the helpers a killed one left). Asked
    without writing anything: a shared lock tried and let go at once."""
    try:
        fd = os.open(spool / f"{WRITER}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # lets go of the lock, if taken
    return True


def leftovers(roots: list[Path]) -> list[Leftover]:
    """The spools under `roots` (each store's `.spool`, replicas' included) that no process
    writes and that hold records their store does not have yet."""
    found = []
    for root in roots:
        for store in store_roots(root):
            spool = store / SPOOL
            if not spool.is_dir() or spool.is_symlink() or not idle(spool):
                continue
            known = cursors(spool)
            if known and STORE_BACKEND not in known:
                continue  # its proxy had other backends only: nothing of it is a store's
            start = known.get(STORE_BACKEND)
            left = spool_records_after(spool, start.next if start is not None else 0)
            if left:
                found.append(Leftover(store, spool, left))
    return found


def notice(found: list[Leftover]) -> str:
    """One line naming what is left, and the command that writes it to the store."""
    where = ", ".join(f"{item.records} in {item.spool}" for item in found)
    roots = " ".join(sorted({str(_output_of(item.store)) for item in found}))
    return (f"trace-proxy: records a stopped proxy did not write to the store are still in "
            f"its spool ({where}): `trace-proxy recover {roots}` writes them")  # fmt: skip


def _output_of(store: Path) -> Path:
    return store.parent.parent if store.parent.name == "replicas" else store
