"""The export process: exporters run in a child process fed from the spool. Its metrics show on
the proxy's /metrics, its start-up errors reach the command line, and when it dies another one
takes over where it stopped, losing and duplicating nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.proxies import running_proxy, trajectories

from trace_proxy.config import ConfigError
from trace_proxy.processes.export import ExportProcess
from trace_proxy.store.readers import iter_records


async def rollouts(session: aiohttp.ClientSession, proxy: str, step: int, count: int) -> None:
    for sample in range(count):
        body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": f"q{sample}"}],
                "max_tokens": 4}  # fmt: skip
        headers = {"X-Rollout-Step": str(step), "X-Rollout-Sample-Index": str(sample),
                   "X-Rollout-Done": "1"}  # fmt: skip
        async with session.post(proxy + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            await r.read()


def threads(pid: int, prefix: str) -> list[int]:
    """The ids of a process's threads whose name starts with `prefix`."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                if comm.read().startswith(prefix):
                    found.append(int(tid))
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return found


def keys(output: Path) -> list[tuple[int, int]]:
    return sorted((t["key"]["step"], t["key"]["sample_index"]) for t in trajectories(output))


async def test_records_go_out_through_the_export_process_and_it_is_replaced_when_it_dies(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, capture_mode="inline") as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        exports = service.inline.pipeline.exports
        assert isinstance(exports, ExportProcess)
        await rollouts(session, proxy, step=1, count=5)
        await service.flush()
        assert keys(tmp_path) == [(1, i) for i in range(5)]
        admin = service.addresses.admin if service.addresses else ""
        async with session.get(admin + "/metrics") as response:
            text = await response.text()
        assert 'trace_proxy_exported_records_total{backend="jsonl"} 5.0' in text
        assert exports.pid is not None and os.getpid() != exports.pid
        # Exporting only takes CPU time that forwarding does not want (--export-priority idle):
        # the threads that export; the event loop keeps the proxy's priority (see `hurry`).
        assert [os.sched_getscheduler(tid) for tid in threads(exports.pid, "export-jsonl")] == [
            os.SCHED_IDLE
        ]
        assert os.sched_getscheduler(exports.pid) == os.sched_getscheduler(0)

        os.kill(exports.pid, signal.SIGKILL)
        await rollouts(session, proxy, step=2, count=5)
        await asyncio.wait_for(service.flush(), 60)  # answered by the new process
        restarts = service.metrics.registry.get_sample_value(
            "trace_proxy_export_process_restarts_total"
        )
        assert restarts == 1
        # What the killed process counted is kept: the counter never falls back.
        exported = service.metrics.registry.get_sample_value(
            "trace_proxy_exported_records_total", {"backend": "jsonl"}
        )
        assert exported == len(list(iter_records(tmp_path)))  # trajectories, step summaries
    assert keys(tmp_path) == [(step, i) for step in (1, 2) for i in range(5)]  # once each


async def test_export_priority_normal_runs_the_export_process_as_the_proxy(
    tmp_path: Path,
) -> None:
    async with running_proxy(
        ["http://127.0.0.1:9"], tmp_path, export_priority="normal", capture_mode="inline"
    ) as (service, _):
        exports = service.inline.pipeline.exports
        assert isinstance(exports, ExportProcess) and exports.pid is not None
        assert os.sched_getscheduler(exports.pid) == os.sched_getscheduler(0)
        assert os.getpriority(os.PRIO_PROCESS, exports.pid) == os.getpriority(os.PRIO_PROCESS, 0)


async def test_a_backend_that_cannot_start_is_a_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"otlp cannot start: .* is not NAME=VALUE"):
        async with running_proxy(
            ["http://127.0.0.1:9"], tmp_path, backend=["otlp"], otlp_header=["no-value"]
        ):
            raise AssertionError("the proxy started with a backend that cannot")


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities, read from /proc")
async def test_at_shutdown_the_export_process_drains_at_the_proxys_priority(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """Raising a thread's priority back needs privileges; the export process instead moves
    its lanes to new threads at the priority its event loop kept (the proxy's)."""
    _, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, capture_mode="inline") as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        exports = service.inline.pipeline.exports
        assert isinstance(exports, ExportProcess) and exports.pid is not None
        pid = exports.pid

        def lanes() -> list[int]:
            return [os.sched_getscheduler(tid) for tid in threads(pid, "export-jsonl")]

        await rollouts(session, proxy, step=1, count=3)
        await service.flush()
        assert lanes() == [os.SCHED_IDLE]
        service.inline.hurry()  # what stopping does first
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while lanes() != [os.sched_getscheduler(0)]:
            assert loop.time() < deadline, lanes()
            await asyncio.sleep(0.05)  # the next read of the spool makes the new thread
        assert os.getpriority(os.PRIO_PROCESS, threads(pid, "export-jsonl")[0]) == (
            os.getpriority(os.PRIO_PROCESS, 0)
        )
        await rollouts(session, proxy, step=2, count=3)
        await service.flush()
    assert keys(tmp_path) == [(step, i) for step in (1, 2) for i in range(3)]
