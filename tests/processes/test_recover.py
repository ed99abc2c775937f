"""What a proxy killed with all its processes left in its spool is never lost silently: `show`
and `export` name it, `trace-proxy recover` writes it to the store, once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.proxies import children
from support.serve import chat, start_serve, stored, until, until_gone, until_ready

from trace_proxy.exporters.leftovers import spool_records_after


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trace_proxy", *args], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_a_spool_left_by_a_proxy_killed_whole_is_named_by_show_and_recovered_once(
    fake_vllm: tuple[Any, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _, upstream = fake_vllm
    proxy_process, proxy, admin = await start_serve(upstream, tmp_path)
    async with aiohttp.ClientSession() as session:
        await until_ready(session, admin)
        await chat(session, proxy, 1, 0)
        await until(lambda: stored(tmp_path) == [(1, 0, 1)])
        [capture] = children(proxy_process.pid)
        [export] = children(capture)
        os.kill(export, signal.SIGSTOP)  # from here on, records stay in the spool
        for sample in (1, 2):
            await chat(session, proxy, 1, sample)
        await until(lambda: spool_records_after(tmp_path / ".spool", 0) == 3)
    # Every process of the proxy at once, as a kill of its whole session does: none drains.
    for pid in (export, capture, proxy_process.pid):
        os.kill(pid, signal.SIGKILL)
    await until_gone([export, capture, proxy_process.pid], within=10)
    await proxy_process.wait()
    assert stored(tmp_path) == [(1, 0, 1)]

    shown = await asyncio.to_thread(cli, "show", str(tmp_path))
    assert shown.returncode == 0
    assert "still in its spool (2 in " in shown.stderr
    assert f"trace-proxy recover {tmp_path}" in shown.stderr
    exported = await asyncio.to_thread(
        cli,
        "export",
        str(tmp_path),
        "--form",
        "sft",
        "--out",
        str(tmp_path_factory.mktemp("sft") / "rows"),
    )
    assert exported.returncode == 0, exported.stderr
    assert "still in its spool (2 in " in exported.stderr

    recovered = await asyncio.to_thread(cli, "recover", str(tmp_path))
    assert recovered.returncode == 0, recovered.stderr
    assert "2 records written to the store" in recovered.stdout
    assert stored(tmp_path) == [(1, 0, 1), (1, 1, 1), (1, 2, 1)]
    assert "spool" not in (await asyncio.to_thread(cli, "show", str(tmp_path))).stderr
    again = await asyncio.to_thread(cli, "recover", str(tmp_path))
    assert "0 records written" in again.stdout
    assert stored(tmp_path) == [(1, 0, 1), (1, 1, 1), (1, 2, 1)]  # nothing twice


async def test_recover_leaves_a_running_proxys_spool_alone(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    proxy_process, _, admin = await start_serve(upstream, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            await until_ready(session, admin)
        recovered = await asyncio.to_thread(cli, "recover", str(tmp_path))
        assert recovered.returncode == 1
        assert "not recovered" in recovered.stdout and "another running trace-proxy" in (
            recovered.stdout)  # fmt: skip
    finally:
        proxy_process.terminate()
        assert await proxy_process.wait() == 0
