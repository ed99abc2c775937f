"""`trace-proxy recover`: what a killed proxy left in its spool, written to its store.

A proxy killed with all its processes at once (nothing could finish) leaves in its spool the
records its jsonl backend had not written (exporters/leftovers.py). This writes them, to the store
beside each spool (replicas included), from that backend's cursor on, so no record is written
twice, decoded as `serve` would with the same token2text options. It takes the spool's locks as
a proxy does: a spool a running proxy holds is refused, the helpers a killed one left are
waited for (within a bound). Records for other backends (MLflow, ...) stay in the spool for a
proxy started again on it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TextIO

from trace_proxy.config import Settings
from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.exporters.leftovers import SPOOL, STORE_BACKEND
from trace_proxy.exporters.spool import SpoolBusy, SpoolWriter, acquire, cursors
from trace_proxy.metrics import ExportMetrics
from trace_proxy.processes.export import export_runner
from trace_proxy.processes.lifeline import leftover_wait
from trace_proxy.processes.text_path import add_token2text
from trace_proxy.store.replicas import store_roots

CLOSE_TIMEOUT = 60.0  # for the store's files to be closed once everything is written


async def recover(roots: list[Path], settings: Settings, out: TextIO) -> int:
    """Write every spool's leftover under `roots` to its store; 1 if one could not be."""
    code = 0
    for root in roots:
        for store in store_roots(root):
            spool = store / SPOOL
            if not spool.is_dir() or spool.is_symlink():
                continue
            try:
                written = await _recover_one(store, spool, settings, out)
            except SpoolBusy as exc:
                out.write(f"trace-proxy: {store}: not recovered: {exc}\n")
                code = 1
                continue
            out.write(f"trace-proxy: {store}: {written} records written to the store\n")
    return code


async def _recover_one(store: Path, spool: Path, settings: Settings, out: TextIO) -> int:
    wait = leftover_wait(settings.shutdown_grace)
    writer = SpoolWriter(spool, max_bytes=settings.spool_max_bytes, locked=False,
                         proxy=os.getpid())  # fmt: skip

    def waiting(why: str) -> None:
        out.write(f"trace-proxy: {store}: {why}\n")

    await acquire(writer.lock, wait, waiting)
    try:
        writer.open()  # a torn tail cut off, as a proxy started on it would
        end = writer.next_seq
        known = cursors(spool).get(STORE_BACKEND)
        start = known.next if known is not None else 0
        if end <= start:
            return 0
        ours = dataclasses.replace(settings, output=store, backend=[STORE_BACKEND])
        metrics = ExportMetrics()
        runner = export_runner(ours, spool, metrics, [JsonlExporter(store)])
        await add_token2text(ours, runner, metrics)
        await runner.start()
        runner.notify(end)
        await runner.flush(end)
        await runner.close(CLOSE_TIMEOUT)
        return end - start
    finally:
        writer.close()
