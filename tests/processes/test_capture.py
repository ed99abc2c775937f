"""The capture process: the forwarder hands exchanges over as raw bytes and parses nothing.

What a user relies on: the records are the same as when parsing ran in the proxy's own process
(the ground truth and every end-to-end test run this mode, the default); a capture process that
falls behind never slows or alters forwarding, and what it cannot take is counted; one that dies
is replaced, its loss counted; a proxy that is killed still has its captured calls recorded.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from support.proxies import children, gone, metric, running_proxy, trajectories
from support.serve import start_serve

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.wire import (
    HEAD,
    OWN_BUFFER_FROM,
    FrameReader,
    encode_control,
    encode_exchange,
)
from trace_proxy.processes.capture import CaptureProcess
from trace_proxy.show import show
from trace_proxy.store.readers import iter_records

GUARD = 60

header_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=20)
exchanges = st.builds(
    Exchange,
    method=st.sampled_from(["POST", "GET", "HEAD"]),
    path=st.text(min_size=1, max_size=30).map(lambda p: "/" + p),
    query=st.text(max_size=20),
    request_headers=st.lists(st.tuples(header_text.filter(bool), header_text), max_size=6).map(
        lambda items: CIMultiDictProxy(CIMultiDict(items))
    ),
    path_metadata=st.lists(st.tuples(header_text, header_text), max_size=3),
    upstream=st.just("http://127.0.0.1:8000"),
    start=st.floats(0, 2e9),
    request_body=st.binary(max_size=300),
    status=st.none() | st.integers(100, 599),
    response_headers=st.none()
    | st.lists(st.tuples(header_text.filter(bool), header_text), max_size=4).map(CIMultiDict),
    response_chunks=st.lists(st.binary(min_size=1, max_size=50), max_size=5),
    first_byte=st.none() | st.floats(0, 2e9),
    end=st.none() | st.floats(0, 2e9),
    error=st.none() | st.text(max_size=30),
    tool_route=st.none() | st.text(min_size=1, max_size=10),
    admitted=st.booleans(),
)


def _fields(exchange: Exchange) -> tuple[Any, ...]:
    response_headers = exchange.response_headers
    return (
        exchange.method, exchange.path, exchange.query, list(exchange.request_headers.items()),
        [tuple(item) for item in exchange.path_metadata], exchange.upstream, exchange.start,
        exchange.request_body, exchange.status,
        None if response_headers is None else list(response_headers.items()),
        exchange.response_body, exchange.first_byte, exchange.end, exchange.error,
        exchange.tool_route, exchange.admitted,
    )  # fmt: skip


class _Transport(asyncio.Transport):
    """Records what the reader asks of its transport (the stream is fed by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.closing = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


@settings(max_examples=300, deadline=None)
@given(
    st.lists(exchanges, min_size=1, max_size=4),
    st.lists(st.integers(1, 400), max_size=30),
    st.sampled_from([1, 40, 200, 64 << 10]),
)
def test_exchanges_cross_the_socket_unchanged_and_in_order(
    sent: list[Exchange], cuts: list[int], own_buffer_from: int
) -> None:
    """However the stream is cut into reads, and whether frames are read into the shared
    buffer or into their own, the frames come out whole and in order."""
    stream = b"".join(b for exchange in sent for b in encode_exchange(exchange))
    stream += encode_control({"op": "stop", "timeout": 1.5})

    async def roundtrip() -> list[Any]:
        reader = FrameReader(max_waiting=2, own_buffer_from=own_buffer_from)
        transport = _Transport()
        reader.connection_made(transport)
        frames: list[Any] = []
        offset = 0
        for cut in [*cuts, len(stream)]:
            reader.feed(stream[offset : offset + cut])
            offset += cut
            if reader.waiting > 2:
                assert transport.paused  # too many waiting: the writer is pushed back
            while reader.waiting:
                frames.append(await reader.next())
            assert not transport.paused  # taken: reading goes on
            if offset >= len(stream):
                break
        reader.eof_received()
        with pytest.raises(EOFError):
            await reader.next()
        return frames

    *received, control = asyncio.run(roundtrip())
    assert [_fields(exchange) for exchange in received] == [_fields(e) for e in sent]
    assert control == {"op": "stop", "timeout": 1.5}


async def test_a_long_stream_of_small_and_long_frames_wraps_around_the_shared_buffer() -> None:
    """More than the shared buffer holds, in reads that end mid-frame: what is left of a frame
    moves to the buffer's front, and long frames in between go to buffers of their own."""
    sent = [
        Exchange(method="POST", path=f"/v1/completions/{i}", query="",
                 request_headers=CIMultiDictProxy(CIMultiDict({"X-N": str(i)})),
                 path_metadata=[], upstream="http://u", start=float(i),
                 request_body=bytes([i % 251]) * (70_000 if i % 97 == 0 else 300 + i % 50),
                 status=200, response_headers=CIMultiDict(), response_chunks=[b"r" * (i % 7)])
        for i in range(2_000)
    ]  # fmt: skip
    stream = b"".join(b for exchange in sent for b in encode_exchange(exchange))
    assert len(stream) > 4 * len(FrameReader()._scratch)
    reader = FrameReader(max_waiting=len(sent))
    reader.connection_made(_Transport())
    for offset in range(0, len(stream), 7_919):  # a prime: every frame boundary falls anywhere
        reader.feed(stream[offset : offset + 7_919])
    received = [await reader.next() for _ in sent]
    assert [_fields(e) for e in received] == [_fields(e) for e in sent]  # type: ignore[arg-type]
    assert reader.waiting == 0


async def test_a_frame_that_is_not_ours_closes_the_connection() -> None:
    reader = FrameReader()
    transport = _Transport()
    reader.connection_made(transport)
    reader.feed(HEAD.pack(7, 2, 0, 0) + b"{}")
    with pytest.raises(ValueError, match="unknown frame kind 7"):
        await reader.next()
    assert transport.closing


async def chat(
    session: aiohttp.ClientSession,
    proxy: str,
    step: int,
    sample: int,
    done: bool = True,
    content: str = "",
) -> bytes:
    """One turn of a keyed trajectory; `done` closes the trajectory."""
    body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": f"q{sample}{content}"}],
            "max_tokens": 4}  # fmt: skip
    headers = {"X-Rollout-Step": str(step), "X-Rollout-Sample-Index": str(sample),
               "X-Rollout-N": "0"}  # fmt: skip
    if done:
        headers["X-Rollout-Done"] = "1"
    async with session.post(proxy + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        return await r.read()


def keys(output: Path) -> list[tuple[int, int]]:
    return sorted((t["key"]["step"], t["key"]["sample_index"]) for t in trajectories(output))


async def test_parsing_runs_in_another_process_which_is_replaced_when_it_dies(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess)
        assert capture.pid is not None and capture.pid != os.getpid()
        for sample in range(4):
            await chat(session, proxy, 1, sample)
        await service.flush()
        assert keys(tmp_path) == [(1, i) for i in range(4)]
        admin = service.addresses.admin if service.addresses else ""
        async with session.get(admin + "/metrics") as response:
            text = await response.text()
        # One family per name, though both processes count drops, requests and more.
        assert text.count("# HELP trace_proxy_capture_dropped_total ") == 1
        assert 'trace_proxy_calls_recorded_total{dialect="openai.chat"} 4.0' in text
        assert 'trace_proxy_requests_total{kind="generate",status="2xx"} 4.0' in text

        # One open trajectory (never marked done): the crash loses its call, and counts it.
        await chat(session, proxy, 1, 99, done=False)
        await service.flush()
        assert capture.open_count == 1
        assert metric(service.metrics, "trace_proxy_open_trajectories") == 1
        assert metric(service.metrics, "trace_proxy_capture_queue") == 0

        os.kill(capture.pid, signal.SIGKILL)
        # Forwarding goes on while the capture process is down and after it is back.
        for sample in range(4, 8):
            assert b'"choices"' in await chat(session, proxy, 2, sample)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GUARD
        while capture.generation < 2 and loop.time() < deadline:
            await asyncio.sleep(0.05)  # the supervisor's restart: nothing to await from here
        await chat(session, proxy, 3, 0)
        await asyncio.wait_for(service.flush(), GUARD)
        target = {"experiment": "default", "step": 3, "sample_index": 0, "rollout_n": 0}
        # Answered by the new capture process.
        async with session.post(admin + "/rewards", json={**target, "reward": 1.0}) as response:
            assert response.status == 200
            assert (await response.json())["attached_to"] == "exported"
        assert metric(service.metrics, "trace_proxy_capture_process_restarts_total") == 1
    recorded = set(keys(tmp_path))
    lost = metric(service.metrics, "trace_proxy_capture_dropped_total",
                  reason="capture_process_lost")  # fmt: skip
    down = metric(service.metrics, "trace_proxy_capture_dropped_total",
                  reason="capture_process_down")  # fmt: skip
    step_two = {key for key in recorded if key[0] == 2}
    assert len(step_two) + lost + down == 4 + 1  # recorded, or counted as lost (+ the open one)
    assert (1, 99) not in recorded
    assert {(1, i) for i in range(4)} | {(3, 0)} <= recorded


async def test_a_flush_right_after_submitting_waits_for_those_exchanges(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """Exchanges are written to the capture process once per loop iteration, together; a
    flush asked for in the same iteration covers them all, even when they are more than the
    socket holds at once."""
    _, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, capture_queue_bytes=2 << 20) as (service, _),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess)
        body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 4}  # fmt: skip
        async with session.post(upstream + "/v1/chat/completions", json=body) as response:
            headers, answer = response.headers.copy(), await response.read()
        loop = asyncio.get_running_loop()
        sent = 0
        while sent * (len(answer) + 600) < 900 << 10:  # above the 512 KiB socket buffer
            rollout = {"Content-Type": "application/json", "X-Rollout-Step": "7",
                       "X-Rollout-Sample-Index": str(sent), "X-Rollout-N": "0",
                       "X-Rollout-Done": "1"}  # fmt: skip
            capture.submit(Exchange(
                "POST", "/v1/chat/completions", "", CIMultiDictProxy(CIMultiDict(rollout)), [],
                upstream, loop.time(), orjson.dumps(body), 200, headers, [answer],
                loop.time(), loop.time(),
            ))  # fmt: skip
            sent += 1
        await asyncio.wait_for(capture.flush(), GUARD)
        assert keys(tmp_path) == [(7, i) for i in range(sent)]
        assert metric(service.metrics, "trace_proxy_capture_dropped_total",
                      reason="capture_queue_bytes") == 0  # fmt: skip


async def sampled_rollouts(
    output: Path, upstream: str, mode: str, policy: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """Step 1: 8 samples of 3 turns; step 2 closes it. The records, the step summaries, and
    (capture process) how many whole exchanges each turn sent."""
    sent = []
    async with (
        running_proxy([upstream], output, capture_mode=mode, **policy) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        for turn in range(3):
            before = capture.bodies_sent if isinstance(capture, CaptureProcess) else 0
            for sample in range(8):
                await chat(session, proxy, 1, sample, done=turn == 2)
            await service.flush()  # what the sampler refused so far is known to the proxy
            if isinstance(capture, CaptureProcess):
                sent.append(capture.bodies_sent - before)
        await chat(session, proxy, 2, 0)
    summaries = [r for _, r in iter_records(output) if r.get("record") == "step_summary"]
    return trajectories(output), summaries, sent


@pytest.mark.parametrize(
    ("policy", "bodies_sent"),
    [
        # Top-N: the capture process names a sample once it refuses it.
        ({"max_samples_per_step": 2}, lambda kept, turn: kept if turn == 2 else None),
        # A rate needs no state: the proxy applies it itself, from the first call.
        ({"sample_rate": 0.5, "sample_seed": 5}, lambda kept, turn: kept),
    ],
)
async def test_calls_of_a_refused_sample_cross_as_heads_and_count_the_same(
    fake_vllm: tuple[Any, str], tmp_path: Path, policy: dict[str, Any], bodies_sent: Any
) -> None:
    """The proxy sends the calls of a sample the sampler refuses (for good) without their
    bodies. What is recorded and counted is what capture in the proxy's own process, which
    decides before keeping any body, gives."""
    _, upstream = fake_vllm
    records, summaries, sent = await sampled_rollouts(
        tmp_path / "process", upstream, "process", policy
    )
    inline_records, inline_summaries, _ = await sampled_rollouts(
        tmp_path / "inline", upstream, "inline", policy
    )
    kept = sorted(t["key"]["sample_index"] for t in records if t["key"]["step"] == 1)
    assert 0 < len(kept) < 8
    assert all(len(t["calls"]) == 3 for t in records if t["key"]["step"] == 1)
    assert kept == sorted(t["key"]["sample_index"] for t in inline_records
                          if t["key"]["step"] == 1)  # fmt: skip
    for turn, count in enumerate(sent):
        expected = bodies_sent(len(kept), turn)
        assert expected is None or count == expected, (turn, sent)  # the others: heads alone
    step_one = [{k: v for k, v in r.items() if k != "time"} for r in summaries if r["step"] == 1]
    inline_step_one = [{k: v for k, v in r.items() if k != "time"} for r in inline_summaries
                       if r["step"] == 1]  # fmt: skip
    assert step_one == inline_step_one and step_one[0]["calls_seen"] == 24


async def test_a_stalled_capture_process_never_holds_up_forwarding(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """A capture process that takes nothing (stopped here) costs forwarding nothing: the
    backlog waits in a bounded buffer; what does not fit is counted, and nothing is lost
    beyond it."""
    _, upstream = fake_vllm
    sent = 60
    async with (
        running_proxy([upstream], tmp_path, capture_queue_bytes=64 << 10) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        direct = await chat(session, upstream, 0, 0)
        os.kill(capture.pid, signal.SIGSTOP)
        try:
            bodies = await asyncio.wait_for(
                asyncio.gather(*(chat(session, proxy, 1, i) for i in range(sent))), GUARD
            )
        finally:
            os.kill(capture.pid, signal.SIGCONT)
        assert all(orjson.loads(b)["choices"] for b in bodies) and len(direct) > 0
        await asyncio.wait_for(service.flush(), GUARD)
        dropped = metric(service.metrics, "trace_proxy_capture_dropped_total",
                         reason="capture_queue_bytes")  # fmt: skip
    records = trajectories(tmp_path)
    assert dropped > 0, "the budget of 64 KiB should not hold 60 exchanges"
    # Every sample has its record: its call, or its dropped call counted (the head got over).
    assert sorted(t["key"]["sample_index"] for t in records) == list(range(sent))
    assert sum(len(t["calls"]) for t in records) + dropped == sent
    assert all(len(t["calls"]) + t["summary"]["calls_dropped"] == 1 for t in records)


@pytest.mark.parametrize("content", ["", "x" * (OWN_BUFFER_FROM + 100)], ids=["short", "long"])
async def test_a_capture_process_behind_keeps_what_its_queue_cannot_hold_on_disk(
    fake_vllm: tuple[Any, str], tmp_path: Path, content: str
) -> None:
    """Parsing behind forwarding (stopped here, with a queue of one exchange): what arrives
    meanwhile waits on disk, not in memory, and is recorded once parsing goes on; nothing is
    dropped. A long exchange waits there as the bytes it arrived in, read into a buffer the
    one before it used: each is recorded as sent."""
    _, upstream = fake_vllm
    sent = 30
    async with (
        running_proxy([upstream], tmp_path, capture_queue=1) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        os.kill(capture.pid, signal.SIGSTOP)
        try:
            for sample in range(sent):
                await asyncio.wait_for(chat(session, proxy, 1, sample, content=content), GUARD)
        finally:
            os.kill(capture.pid, signal.SIGCONT)
        await asyncio.wait_for(service.flush(), GUARD)
        overflowed = metric(service.metrics, "trace_proxy_capture_overflowed_total")
        dropped = sum(
            metric(service.metrics, "trace_proxy_capture_dropped_total", reason=reason)
            for reason in ("capture_queue_bytes", "capture_queue_full", "capture_overflow")
        )
    assert overflowed > 0 and dropped == 0
    assert keys(tmp_path) == [(1, sample) for sample in range(sent)]
    assert all(len(t["calls"]) == 1 for t in trajectories(tmp_path))
    assert sorted(
        t["calls"][0]["prompt"]["messages"][0]["content"] for t in trajectories(tmp_path)
    ) == sorted(f"q{sample}{content}" for sample in range(sent))
    assert list((tmp_path / ".spool").glob("*overflow*")) == []


async def test_a_call_dropped_for_lack_of_room_still_counts_in_its_trajectory(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """What a stalled capture process cannot hold is dropped, but its trajectory says how many
    calls it lacks, and a dropped `done` call still closes it (instead of it waiting, with its
    prompts, for the next step)."""
    _, upstream = fake_vllm
    samples = 30

    async def rest_of_rollout(sample: int) -> None:
        await chat(session, proxy, 1, sample, done=False)
        await chat(session, proxy, 1, sample, done=True)

    async with (
        running_proxy([upstream], tmp_path, capture_queue_bytes=64 << 10) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        for sample in range(samples):
            await chat(session, proxy, 1, sample, done=False)
        await asyncio.wait_for(service.flush(), GUARD)
        os.kill(capture.pid, signal.SIGSTOP)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(rest_of_rollout(sample) for sample in range(samples))), GUARD
            )
        finally:
            os.kill(capture.pid, signal.SIGCONT)
        await asyncio.wait_for(service.flush(), GUARD)
        dropped = metric(service.metrics, "trace_proxy_capture_dropped_total",
                         reason="capture_queue_bytes")  # fmt: skip
    stored = list(trajectories(tmp_path))
    assert dropped > 0, "the budget of 64 KiB should not hold 60 exchanges"
    assert sorted(t["key"]["sample_index"] for t in stored) == list(range(samples))
    assert {t["close_reason"] for t in stored} == {"done"}
    assert all(t["summary"]["calls"] + t["summary"]["calls_dropped"] == 3 for t in stored)
    assert sum(t["summary"]["calls_dropped"] for t in stored) == dropped
    shown = io.StringIO()
    assert show(tmp_path, out=shown) == 0
    gaps = shown.getvalue().count("more calls not recorded (capture fell behind)")
    assert gaps == sum(1 for t in stored if t["summary"]["calls_dropped"])


async def recorded_calls(session: aiohttp.ClientSession, admin: str) -> float:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("trace_proxy_calls_recorded_total{")
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
async def test_a_killed_proxy_still_has_its_captured_calls_recorded(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    """SIGKILL leaves no time to flush; the capture process sees its socket close, parses
    what it received, closes the open trajectories and exports them."""
    _, upstream = fake_vllm
    process, proxy, admin = await start_serve(upstream, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):  # one open trajectory: never marked done
                await chat(session, proxy, 7, 0, done=False)
            # A client has its answer a moment before the exchange is handed over: kill the
            # proxy only once the capture process has all three (what it holds is the test).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + GUARD
            while await recorded_calls(session, admin) < 3 and loop.time() < deadline:
                await asyncio.sleep(0.05)  # the count is relayed periodically: polled
        helpers = children(process.pid)
        assert helpers, "the capture process should be running"
    finally:
        process.kill()
        await process.wait()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not all(gone(pid) for pid in helpers) and loop.time() < deadline:
        await asyncio.sleep(0.1)  # polling an orphan's exit: nothing can be awaited
    [trajectory] = trajectories(tmp_path)
    assert trajectory["key"]["step"] == 7 and len(trajectory["calls"]) == 3
    assert trajectory["close_reason"] == "shutdown"


async def test_the_capture_process_lets_forwarding_have_the_cores_first(tmp_path: Path) -> None:
    """By default (`--capture-priority low`): nice 19 against the forwarder."""
    async with running_proxy(["http://127.0.0.1:9"], tmp_path) as (service, _):
        capture = service.recorder
        assert isinstance(capture, CaptureProcess) and capture.pid is not None
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, capture.pid) == min(ours + 19, 19)
