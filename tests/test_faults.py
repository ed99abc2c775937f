"""Fault injection with exact reconciliation: whatever the upstream, the client or the disk
does, every call handed to capture is in the store exactly once or counted as dropped with its
reason, /metrics agrees with the store, and every answer the client got is the upstream's.

Each request names a trajectory of its own (`X-Rollout-Trajectory-Id`, done at once), so the
store says call by call what became of it. Synchronisation is by events and polls with a
deadline, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from fakes.serving import serve_app
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families
from support.proxies import (
    children,
    closed_port,
    metric,
    running_proxy,
    scripted_upstream,
    trajectories,
)

from trace_proxy.metrics import Metrics, exposition

GUARD = 30.0  # seconds: a failure bound, not a synchronisation
OK_BODY = orjson.dumps({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
SSE = [b'data: {"choices": [{"index": 0, "text": "o"}]}\n\n',
       b'data: {"choices": [{"index": 0, "text": "k", "finish_reason": "stop"}]}\n\n',
       b"data: [DONE]\n\n"]  # fmt: skip
FAULTS = ("ok", "stream", "reset_mid_stream", "hang", "garbage", "huge_headers", "error_500",
          "client_leaves_mid_stream", "client_leaves_mid_body")  # fmt: skip


async def chaos_upstream(request: web.Request) -> web.StreamResponse:
    """Behaves as the request's `X-Fault` says."""
    fault = request.headers["X-Fault"]
    await request.read()
    transport = request.transport
    assert transport is not None
    if fault == "ok":
        return web.Response(body=OK_BODY, content_type="application/json")
    if fault == "error_500":
        return web.json_response({"error": "engine dead"}, status=500)
    if fault == "hang":
        await asyncio.Event().wait()  # ended by the proxy's read timeout
    if fault == "garbage":
        transport.write(b"\x00\xffthis is not HTTP at all\r\n\r\n")
        transport.close()
        return web.Response()
    if fault == "huge_headers":
        head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (3 << 20) + b"\r\nContent-Length: 0\r\n\r\n"
        transport.write(head)
        await asyncio.Event().wait()  # the proxy gives up first
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(SSE[0])
    if fault == "reset_mid_stream":
        transport.abort()
        return response
    if fault == "client_leaves_mid_stream":
        await asyncio.Event().wait()  # until the client's departure cancels it
    for event in SSE[1:]:
        await response.write(event)
    return response


def headers(tid: str, fault: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Fault": fault,
            "X-Rollout-Trajectory-Id": tid, "X-Rollout-Done": "true"}  # fmt: skip


async def leave_mid_body(proxy: str, tid: str) -> None:
    """Headers announce 1 MiB, half of it is sent, then the connection closes."""
    host, port = proxy.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers(tid, "client_leaves_mid_body").items())
    body = b'{"prompt": "' + b"x" * (1 << 20)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head.encode()
                 + b"Content-Length: %d\r\n\r\n" % (len(body) + 2) + body[: 1 << 19])  # fmt: skip
    await writer.drain()
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def one_call(session: aiohttp.ClientSession, proxy: str, tid: str, fault: str) -> str:
    """What the client got: a status, `cut` (a stream that broke), or `left`."""
    if fault == "client_leaves_mid_body":
        await leave_mid_body(proxy, tid)
        return "left"
    stream = fault not in ("ok", "error_500", "hang", "garbage", "huge_headers")
    body = {"prompt": f"call {tid}", "max_tokens": 2, "stream": stream}
    async with session.post(proxy + "/v1/completions", json=body, headers=headers(tid, fault)) as r:
        if fault == "client_leaves_mid_stream":
            assert await r.content.readuntil(b"\n\n") == SSE[0]
            r.close()
            return "left"
        try:
            received = await r.read()
        except aiohttp.ClientPayloadError:
            return "cut"
        if fault == "ok" and r.status == 200:
            assert received == OK_BODY
        if fault == "stream":
            assert received == b"".join(SSE)
        return str(r.status)


def total(metrics: Metrics, name: str) -> float:
    """A counter summed over its labels, as /metrics shows it."""
    families = text_string_to_metric_families(exposition(metrics.registry).decode())
    return sum(s.value for f in families for s in f.samples if s.name == name)


def reconcile(output: Path, metrics: Metrics, sent: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every call sent is stored exactly once or counted as dropped; /metrics agrees."""
    stored = trajectories(output)
    by_tid = Counter(t["key"]["trajectory_id"] for t in stored)
    assert set(by_tid) <= set(sent), "a call was recorded that nobody sent"
    assert all(n == 1 for n in by_tid.values()), "a call was recorded twice"
    assert all(len(t["calls"]) == 1 for t in stored)
    dropped = sum(
        metric(metrics, "trace_proxy_capture_dropped_total", reason=reason)
        for reason in ("capture_queue_full", "capture_queue_bytes", "capture_process_down",
                       "capture_process_lost", "internal_error")
    )  # fmt: skip
    assert len(stored) + dropped == len(sent)
    recorded = total(metrics, "trace_proxy_calls_recorded_total")
    assert recorded + total(metrics, "trace_proxy_calls_unparsed_total") == len(stored)
    return {t["key"]["trajectory_id"]: t["calls"][0] for t in stored}


async def test_upstream_and_client_faults_under_load_are_each_recorded_exactly_once(
    tmp_path: Path,
) -> None:
    plan = {f"call-{i}": FAULTS[i % len(FAULTS)] for i in range(len(FAULTS) * 12)}
    order = list(plan)
    random.Random(18).shuffle(order)
    async with (
        scripted_upstream(chaos_upstream) as upstream,
        running_proxy([upstream], tmp_path, read_timeout=1.0) as (service, proxy),
    ):
        connector = aiohttp.TCPConnector(limit=24)
        async with aiohttp.ClientSession(connector=connector) as session:
            answers = await asyncio.wait_for(
                asyncio.gather(*(one_call(session, proxy, tid, plan[tid]) for tid in order)),
                GUARD * 4,
            )
            got = dict(zip(order, answers, strict=True))
            # Still serving, and still recording.
            assert await one_call(session, proxy, "after", "ok") == "200"
            plan["after"] = "ok"
        await service.flush()
        metrics = service.metrics
    expected = {"ok": "200", "stream": "200", "error_500": "500", "hang": "504",
                "garbage": "502", "huge_headers": "502", "reset_mid_stream": "cut",
                "client_leaves_mid_stream": "left", "client_leaves_mid_body": "left"}  # fmt: skip
    assert {tid: got[tid] for tid in order} == {tid: expected[plan[tid]] for tid in order}
    calls = reconcile(tmp_path, metrics, plan)
    assert set(calls) == set(plan), "nothing was dropped: every call is in the store"
    for tid, call in calls.items():
        fault = plan[tid]
        error = call.get("error") or {}
        if fault in ("ok", "stream"):
            assert call["http_status"] == 200 and call["outputs"][0]["text"] == "ok"
        elif fault == "error_500":
            assert call["http_status"] == 500 and error["type"] == "http_500"
        elif fault in ("hang", "garbage", "huge_headers"):
            assert call["http_status"] == int(expected[fault]) and error["type"] == "transport"
        elif fault == "reset_mid_stream":
            assert "mid-response" in error["message"]
        else:
            assert error == {"type": "transport", "message": "client disconnected"}, (fault, call)


async def test_a_refusing_upstream_answers_502_and_each_call_is_recorded_once(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    sent = {f"call-{i}": "ok" for i in range(40)}
    async with running_proxy([dead], tmp_path) as (service, proxy):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8)) as session:
            answers = await asyncio.gather(*(one_call(session, proxy, t, "ok") for t in sent))
        await service.flush()
        metrics = service.metrics
    assert set(answers) == {"502"}
    calls = reconcile(tmp_path, metrics, sent)
    assert set(calls) == set(sent)
    assert all(
        c["http_status"] == 502 and c["error"]["type"] == "transport" for c in calls.values()
    )


@contextlib.asynccontextmanager
async def tiny_disk(path: Path, size: str) -> AsyncIterator[Path]:
    """A tmpfs of `size` at `path`: a disk that fills up (needs the right to mount)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


async def test_a_full_spool_disk_drops_and_counts_but_never_fails_a_request(
    tmp_path: Path,
) -> None:
    """The spool's disk fills up: every request is still answered byte for byte; records wait
    in memory (a bounded queue) and past it are dropped and counted (`spool_error`); once the
    disk has room again, recording resumes where it was."""
    sent: list[str] = []

    async def send(session: aiohttp.ClientSession, proxy: str, n: int) -> None:
        for _ in range(n):
            tid = f"call-{len(sent)}"
            body = {"prompt": "x" * 2000 + tid, "max_tokens": 2}
            async with session.post(proxy + "/v1/completions", json=body,
                                    headers=headers(tid, "ok")) as response:  # fmt: skip
                assert response.status == 200 and await response.read() == OK_BODY
            sent.append(tid)

    async with (
        tiny_disk(tmp_path / "spool", "4m") as spool,
        scripted_upstream(chaos_upstream) as upstream,
        running_proxy([upstream], tmp_path / "out", spool_dir=spool, export_queue=8) as (
            service,
            proxy,
        ),
        aiohttp.ClientSession() as session,
    ):
        await send(session, proxy, 5)
        await service.flush()
        ballast = spool / "ballast"
        with ballast.open("wb") as fill, contextlib.suppress(OSError):
            while True:  # until the disk is full
                fill.write(b"\0" * 65536)
                fill.flush()
        await send(session, proxy, 40)
        ballast.unlink()
        await service.flush()  # what memory held is spooled once the disk has room
        await send(session, proxy, 5)
        await service.flush()
        metrics = service.metrics
    stored = Counter(t["key"]["trajectory_id"] for t in trajectories(tmp_path / "out"))
    assert set(stored) <= set(sent) and all(n == 1 for n in stored.values())
    dropped = total(metrics, "trace_proxy_spool_dropped_total")
    assert dropped > 0, "the disk was full for 40 calls: more than the memory queue holds"
    assert len(stored) + dropped == len(sent)
    assert {f"call-{i}" for i in (*range(5), *range(45, 50))} <= set(stored)


async def poll(condition: Any, what: str, deadline: float = GUARD) -> None:
    """Wait until `condition()` holds, checking as the event loop turns; fail after the
    deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def receiver_on(port: int) -> AsyncIterator[list[ExportTraceServiceRequest]]:
    """An OTLP/HTTP traces endpoint on a given port, for as long as the `with` lasts."""
    received: list[ExportTraceServiceRequest] = []

    async def handle(request: web.Request) -> web.Response:
        received.append(ExportTraceServiceRequest.FromString(await request.read()))
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/traces", handle)
    async with serve_app(app, port=port):
        yield received


def trajectory_ids(received: list[ExportTraceServiceRequest]) -> list[str]:
    """The trajectory id of each trajectory's root span, as often as it arrived."""
    ids = []
    for request in received:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.parent_span_id:
                        continue
                    for attribute in span.attributes:
                        if attribute.key == "rollout.trajectory_id":
                            ids.append(attribute.value.string_value)
    return ids


async def test_a_backend_down_at_start_and_mid_run_gets_every_record_once_when_back(
    tmp_path: Path,
) -> None:
    """OTLP is down when the proxy starts, comes up, goes down mid-run and comes back: the
    records wait in the spool, and the receiver ends with each trajectory exactly once."""
    port = closed_port()
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    sent: list[str] = []

    async def send(session: aiohttp.ClientSession, proxy: str, n: int) -> None:
        for _ in range(n):
            tid = f"call-{len(sent)}"
            async with session.post(proxy + "/v1/completions", json={"prompt": tid},
                                    headers=headers(tid, "ok")) as response:  # fmt: skip
                assert response.status == 200
            sent.append(tid)

    async with (
        scripted_upstream(chaos_upstream) as upstream,
        running_proxy([upstream], tmp_path, backend=["jsonl", "otlp"], otlp_endpoint=endpoint) as (
            service,
            proxy,
        ),
        aiohttp.ClientSession() as session,
    ):
        exported = lambda: metric(  # noqa: E731
            service.metrics, "trace_proxy_exported_records_total", backend="otlp"
        )
        received: list[Any] = []
        await send(session, proxy, 10)  # down at start
        async with receiver_on(port) as got:
            await send(session, proxy, 10)
            await poll(lambda: len(trajectory_ids(got)) == 20, "the first 20 over OTLP")
            received += got
        await send(session, proxy, 10)  # down mid-run
        async with receiver_on(port) as got:
            await service.flush()
            received += got
        assert exported() >= 30
    ids = trajectory_ids(received)
    assert sorted(ids) == sorted(sent), "each trajectory arrived exactly once"
    assert {t["key"]["trajectory_id"] for t in trajectories(tmp_path)} == set(sent)


async def ready(session: aiohttp.ClientSession, admin: str) -> None:
    """Until /ready says 200 (every helper process up), within the guard."""
    loop = asyncio.get_running_loop()
    end = loop.time() + GUARD
    while True:
        async with session.get(admin + "/ready") as response:
            if response.status == 200:
                return
        assert loop.time() < end, "never ready"
        await asyncio.sleep(0.1)  # readiness is a state to poll, not an event to await


async def admin_metric(session: aiohttp.ClientSession, admin: str, name: str) -> float:
    """A counter of a running `trace-proxy serve`, summed over its labels."""
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
@pytest.mark.parametrize("victim", ["export", "capture"])
async def test_a_helper_killed_under_load_is_replaced_and_its_records_reconcile(
    tmp_path: Path, victim: str
) -> None:
    """SIGKILL of the capture or the export process at a random moment under load, once it
    has been spooling and exporting for a while: forwarding never fails, another process
    takes over and records what comes after. The export process holds nothing of its own (the
    spool does): every call is stored exactly once. The capture process holds what it has not
    spooled yet: each call is stored exactly once or counted as lost, never both."""
    from support.serve import start_serve

    rng = random.Random(f"{victim}-18")
    before, during, after = 100, 100, 40
    kill_after = before + rng.randrange(1, during)
    sent: list[str] = []
    restarts = f"trace_proxy_{victim}_process_restarts_total"
    lost, recorded, exported = (
        "trace_proxy_capture_dropped_total",
        "trace_proxy_calls_recorded_total",
        "trace_proxy_exported_records_total",
    )
    async with scripted_upstream(chaos_upstream) as upstream:
        process, proxy, admin = await start_serve(upstream, tmp_path)
        try:
            connector = aiohttp.TCPConnector(limit=16)
            async with aiohttp.ClientSession(connector=connector) as session:
                await ready(session, admin)
                [capture] = children(process.pid)
                target = capture if victim == "capture" else children(capture)[0]

                async def call(tid: str) -> None:
                    assert await one_call(session, proxy, tid, "ok") == "200"
                    sent.append(tid)
                    if len(sent) == kill_after:
                        os.kill(target, signal.SIGKILL)

                async def calls(first: int, count: int) -> None:
                    await asyncio.wait_for(
                        asyncio.gather(*(call(f"call-{i}") for i in range(first, first + count))),
                        GUARD * 4,
                    )

                async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
                    end = asyncio.get_running_loop().time() + GUARD * 2
                    while not await condition():
                        assert asyncio.get_running_loop().time() < end, what
                        await asyncio.sleep(0.1)  # relayed metrics and /ready: polled

                async def some_exported() -> bool:
                    return await admin_metric(session, admin, exported) >= before // 2

                async def replaced() -> bool:
                    """The victim restarted and, for the capture process, what it lost counted
                    (/ready says so once the new one has opened the spool)."""
                    if await admin_metric(session, admin, restarts) < 1:
                        return False
                    async with session.get(admin + "/ready") as response:
                        return response.status == 200

                async def caught_up() -> bool:
                    """Every call recorded by the capture side exported (and counted)."""
                    done = await admin_metric(session, admin, recorded)
                    return await admin_metric(session, admin, exported) >= done

                await calls(0, before)
                await until(some_exported, "nothing was exported before the kill")
                await calls(before, during)  # the kill comes at a random moment of these
                await until(replaced, f"the {victim} process was not replaced")
                await calls(before + during, after)
                if victim == "export":
                    await until(caught_up, "the calls were never exported")
                dropped = await admin_metric(session, admin, lost)
                assert await admin_metric(session, admin, restarts) == 1
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), GUARD) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    total_calls = before + during + after
    stored = Counter(t["key"]["trajectory_id"] for t in trajectories(tmp_path))
    assert set(stored) <= set(sent) and all(n == 1 for n in stored.values())
    assert {f"call-{i}" for i in range(before + during, total_calls)} <= set(stored)
    if victim == "export":
        assert dropped == 0 and len(stored) == total_calls
    else:
        assert len(stored) >= before // 2  # what was spooled before the kill is kept
        assert len(stored) + dropped == total_calls, (len(stored), dropped)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
async def test_the_proxy_killed_under_load_then_restarted_stores_each_call_at_most_once(
    tmp_path: Path,
) -> None:
    """SIGKILL of the forwarding process at a random moment under load (16 calls in flight),
    then a new proxy on the same store. Its helpers record everything they were handed; what
    was answered in the killed process's last turn of its event loop, not yet handed over, is
    lost with the process that would have counted it: at most what was in flight."""
    from support.serve import start_serve, until_gone

    concurrency, total_calls = 16, 200
    kill_after = random.Random("proxy-18").randrange(40, 160)
    answered: list[str] = []
    attempted: list[str] = []
    async with scripted_upstream(chaos_upstream) as upstream:
        process, proxy, admin = await start_serve(upstream, tmp_path)
        try:
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:
                await ready(session, admin)
                helpers = children(process.pid)
                helpers += [pid for pid in helpers for pid in children(pid)]

                async def call(tid: str) -> None:
                    attempted.append(tid)
                    with contextlib.suppress(aiohttp.ClientError):
                        if await one_call(session, proxy, tid, "ok") == "200":
                            answered.append(tid)
                            if len(answered) == kill_after:
                                process.kill()

                await asyncio.wait_for(
                    asyncio.gather(*(call(f"call-{i}") for i in range(total_calls))), GUARD * 4
                )
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()
        await until_gone(helpers, within=GUARD)  # they finish what they hold, then leave
        second, _, admin = await start_serve(upstream, tmp_path)
        try:
            async with aiohttp.ClientSession() as session:
                await ready(session, admin)  # the spool is ours: what the first left is exported
        finally:
            second.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(second.wait(), GUARD) == 0
    stored = Counter(t["key"]["trajectory_id"] for t in trajectories(tmp_path))
    assert all(n == 1 for n in stored.values()), "a call stored twice"
    assert set(stored) <= set(attempted)
    assert len(set(answered) - set(stored)) <= concurrency
    assert len(answered) >= kill_after
