"""Exchanges the capture queue cannot hold wait on disk, in order, instead of being dropped."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from processes.test_capture import _fields, _Transport

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.overflow import Overflow, OverflowLost
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.capture.wire import HEAD, Frame, FrameReader, LongFrame, encode_exchange
from trace_proxy.metrics import Metrics
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.gate import SamplingGate
from trace_proxy.trajectories.ledger import Ledger
from trace_proxy.trajectories.record import Record, Trajectory, ids_list
from trace_proxy.trajectories.sampler import Policy, Sampler


def exchange(sample: int, turn: int, prompt: list[int], done: bool = False) -> Exchange:
    headers = CIMultiDict({
        "X-Rollout-Step": "1", "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0",
        "X-Note": "café ☕",
    })  # fmt: skip
    if done:
        headers["X-Rollout-Done"] = "true"
    request = orjson.dumps({"prompt": prompt, "max_tokens": 2})
    response = orjson.dumps(
        {
            "choices": [
                {"index": 0, "text": f"t{turn}", "token_ids": [turn, turn], "finish_reason": "stop"}
            ]
        }
    )
    return Exchange(
        method="POST", path="/v1/completions", query="a=1", request_headers=CIMultiDictProxy(
            headers), path_metadata=[("step", "1")], upstream="http://u", start=100.0 + turn,
        request_body=request, status=200, response_headers=CIMultiDict(
            {"Content-Type": "application/json"}), response_chunks=[response[:5], response[5:]],
        first_byte=100.2 + turn, end=100.5 + turn, admitted=turn % 2 == 0,
    )  # fmt: skip


def fields(exchange: Exchange) -> tuple[object, ...]:
    return (*_fields(exchange), exchange.dropped, exchange.bodies_skipped)


def test_exchanges_come_back_from_disk_as_they_went_in_and_the_file_is_emptied(
    tmp_path: Path,
) -> None:
    overflow = Overflow(tmp_path / "spool", 1 << 20)
    sent = [exchange(s, t, list(range(50 * t))) for s in range(3) for t in range(4)]
    for item in sent[:6]:
        overflow.append(item)
    back = [overflow.pop() for _ in range(4)]
    for item in sent[6:]:  # appended while some wait: still read in order
        overflow.append(item)
    assert overflow.next_size() == len(sent[4].request_body) + len(sent[4].response_body)
    back += [overflow.pop() for _ in range(len(sent) - 4)]
    assert [fields(b) for b in back] == [fields(a) for a in sent]
    assert [b.size for b in back] == [len(a.request_body) + len(a.response_body) for a in sent]
    assert overflow.count == 0 and overflow.disk_bytes == 0
    assert overflow._fd is not None and os.fstat(overflow._fd).st_size == 0  # blocks freed
    assert os.listdir(tmp_path / "spool") == []  # the file has no name: it goes with us
    with pytest.raises(IndexError):
        overflow.pop()
    overflow.close()


def test_the_overflow_never_grows_past_its_budget(tmp_path: Path) -> None:
    item = exchange(0, 1, list(range(100)))
    overflow = Overflow(tmp_path, 4096)
    taken = 0
    while overflow.append(item):
        taken += 1
    assert (
        taken > 0
        and overflow.disk_bytes <= 4096 < overflow.disk_bytes + overflow.disk_bytes // taken
    )
    assert overflow.pop_head().request_body == b""  # a head alone, for the mark of a drop


def test_a_damaged_overflow_is_reported_never_misread(tmp_path: Path) -> None:
    overflow = Overflow(tmp_path, 1 << 20)
    overflow.append(exchange(0, 1, [1, 2, 3]))
    overflow.append(exchange(0, 2, [1, 2, 3, 4]))
    assert overflow._fd is not None
    os.ftruncate(overflow._fd, overflow.disk_bytes - 10)
    overflow.pop()
    with pytest.raises(OverflowLost):
        overflow.pop()


def stage_with_overflow(
    tmp_path: Path, max_bytes: int = 1 << 20
) -> tuple[CaptureStage, list[Record], Metrics, Ledger]:
    out: list[Record] = []
    metrics, ledger = Metrics(), Ledger()
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=60,
                          ledger=ledger)  # fmt: skip
    stage = CaptureStage(
        MetadataResolver([]), assembler, metrics, project="p", experiment="e", queue_size=100,
        idle_check_interval=60, queue_bytes=1000, ledger=ledger,
        overflow=Overflow(tmp_path, max_bytes),
    )  # fmt: skip
    return stage, out, metrics, ledger


def rollouts(samples: int, turns: int) -> list[Exchange]:
    """Turns of `samples` rollouts interleaved, each prompt continuing the one before."""
    return [
        exchange(sample, turn, list(range(40 * (turn + 1))), done=turn == turns - 1)
        for turn in range(turns)
        for sample in range(samples)
    ]


async def test_a_full_queue_sends_exchanges_to_disk_and_they_are_parsed_in_order(
    tmp_path: Path,
) -> None:
    """A queue of 1000 bytes holds the first few exchanges here: `put` never waits, the rest
    waits on disk, and every call is recorded in its trajectory in order, as if nothing had
    waited."""
    stage, out, metrics, ledger = stage_with_overflow(tmp_path)
    sent = rollouts(samples=5, turns=4)
    for item in sent:  # the stage is not started: nothing is parsed meanwhile
        await asyncio.wait_for(stage.put(item), 5)
    overflow = stage._overflow
    assert overflow is not None and overflow.count >= len(sent) - 5
    assert stage._queue.qsize() + overflow.count == len(sent)
    gauges = {
        m.name: m.samples[0].value
        for m in metrics.registry.collect()
        if m.type == "gauge" and len(m.samples) == 1
    }
    assert gauges["trace_proxy_capture_queue"] == len(sent)
    assert gauges["trace_proxy_capture_overflow_bytes"] == overflow.disk_bytes > 0
    stage.start()
    caught_up = asyncio.ensure_future(stage.caught_up())
    await asyncio.wait_for(stage.drain(), 10)
    assert caught_up.done()
    await stage.stop()
    built = sorted((r for r in out if isinstance(r, Trajectory)), key=lambda t: t.key.sample_index)
    assert [t.key.sample_index for t in built] == list(range(5))
    assert all(t.close_reason == "done" and len(t.calls) == 4 for t in built)
    assert all([c.outputs[0].text for c in t.calls] == ["t0", "t1", "t2", "t3"] for t in built)
    assert metrics.capture_dropped.labels("capture_queue_bytes")._value.get() == 0
    assert ledger.settled == 0  # nothing dropped, nothing with nothing to record
    assert overflow.disk_bytes == 0


async def test_a_full_overflow_makes_put_wait_and_order_is_kept(tmp_path: Path) -> None:
    item = rollouts(1, 1)[0]
    size = len(item.request_body) + len(item.response_body)
    stage, out, _, _ = stage_with_overflow(tmp_path, max_bytes=3 * (size + 600))
    sent = rollouts(samples=12, turns=1)
    puts = asyncio.ensure_future(asyncio.gather(*(stage.put(x) for x in sent)))
    for _ in range(5):  # turns of the loop for the puts to go as far as they can: nothing
        await asyncio.sleep(0)  # parses (the stage is not started), so the rest must wait
    assert not puts.done(), "a full overflow must make put wait"
    overflow = stage._overflow
    assert overflow is not None and 0 < overflow.count < len(sent) - 1
    assert overflow.disk_bytes <= overflow.max_bytes
    stage.start()
    await asyncio.wait_for(puts, 10)
    await asyncio.wait_for(stage.drain(), 10)
    await stage.stop()
    built = [r for r in out if isinstance(r, Trajectory)]
    assert [t.key.sample_index for t in built] == list(range(12))  # closed in arrival order


async def test_what_waits_on_disk_at_a_stop_is_counted_as_dropped_calls(tmp_path: Path) -> None:
    stage, out, metrics, ledger = stage_with_overflow(tmp_path)
    sent = rollouts(samples=4, turns=2)
    for item in sent:
        await stage.put(item)
    stage.start()
    await stage.stop(parse_within=0)
    built = sorted((r for r in out if isinstance(r, Trajectory)), key=lambda t: t.key.sample_index)
    assert [t.key.sample_index for t in built] == list(range(4))
    calls = sum(t.summary["calls"] for t in built)
    dropped = sum(t.summary["calls_dropped"] for t in built)
    assert calls + dropped == len(sent) and dropped > 0
    assert metrics.capture_dropped.labels("shutdown")._value.get() == dropped == ledger.settled
    assert all(t.close_reason == "done" for t in built)  # a dropped done still closes


async def test_an_overflow_that_cannot_be_read_back_is_counted_and_nothing_waits_for_it(
    tmp_path: Path,
) -> None:
    stage, out, metrics, ledger = stage_with_overflow(tmp_path)
    sent = rollouts(samples=10, turns=1)
    for item in sent:
        await stage.put(item)
    overflow = stage._overflow
    assert overflow is not None and overflow._fd is not None and overflow.count > 2
    waiting = overflow.count
    os.ftruncate(overflow._fd, 0)  # the disk lost it
    stage.start()
    caught_up = asyncio.ensure_future(stage.caught_up())
    await asyncio.wait_for(stage.drain(), 10)
    await asyncio.wait_for(caught_up, 10)
    lost = metrics.capture_dropped.labels("capture_overflow")._value.get()
    assert lost == waiting == ledger.settled
    await stage.stop()
    built = [r for r in out if isinstance(r, Trajectory)]
    assert len(built) == len(sent) - waiting


def long_frames(sent: list[Exchange], own_buffer_from: int) -> list[Frame]:
    """`sent` as the capture process's reader gives them: those of `own_buffer_from` bytes or
    more (each fed in two reads, its head first) not taken apart."""
    reader = FrameReader(len(sent) + 1, own_buffer_from, defer_long=True)
    reader.connection_made(_Transport())
    for item in sent:
        frame = b"".join(encode_exchange(item))
        reader.feed(frame[: HEAD.size + 4])
        reader.feed(frame[HEAD.size + 4 :])
    return list(reader._frames)


async def test_long_frames_wait_on_disk_as_they_came_and_are_recorded_as_if_decoded(
    tmp_path: Path,
) -> None:
    """While exchanges wait on disk, a long frame joins them without being decoded; what comes
    back is the exchange itself, and the records are those of frames decoded at once."""
    sent = rollouts(samples=5, turns=4)
    frames = long_frames(sent, own_buffer_from=400)
    assert sum(isinstance(f, LongFrame) for f in frames) > len(sent) // 2
    assert [fields(f.decode() if isinstance(f, LongFrame) else f) for f in frames] == [
        fields(x) for x in sent
    ]

    async def record(defer: bool) -> tuple[list[Trajectory], int]:
        stage, out, metrics, ledger = stage_with_overflow(tmp_path / str(defer))
        spilled = 0
        for frame in frames:  # the stage is not started: the queue fills, the rest spills
            if isinstance(frame, LongFrame):
                if defer and stage.spill_long(frame):
                    spilled += 1
                    continue
                frame = frame.decode()
            assert isinstance(frame, Exchange)
            await asyncio.wait_for(stage.put(frame), 5)
        assert metrics.capture_overflowed._value.get() >= spilled
        stage.start()
        await asyncio.wait_for(stage.drain(), 10)
        await stage.stop()
        assert ledger.settled == 0
        return [r for r in out if isinstance(r, Trajectory)], spilled

    (decoded, none), (deferred, spilled) = await record(False), await record(True)
    assert none == 0 and spilled > len(sent) // 2

    def calls(trajectories: list[Trajectory]) -> list[tuple[object, ...]]:
        return [
            (t.key, t.close_reason, [(c.start, ids_list(c.prompt.token_ids), c.prompt.prefix_call,
                                      c.prompt.prefix_len, c.outputs, c.request_headers)
             for c in t.calls])
            for t in trajectories
        ]  # fmt: skip

    assert calls(deferred) == calls(decoded) and len(decoded) == 5


async def test_a_long_frame_is_decoded_first_when_nothing_waits_or_a_sampler_needs_its_headers(
    tmp_path: Path,
) -> None:
    stage, _, _, _ = stage_with_overflow(tmp_path)
    (frame,) = long_frames(rollouts(1, 1), own_buffer_from=100)
    assert isinstance(frame, LongFrame)
    assert not stage.spill_long(frame)  # an empty queue has room: parsed from memory
    overflow = stage._overflow
    assert overflow is not None
    assert overflow.append(rollouts(1, 1)[0])  # something waits on disk: it goes after it
    assert stage.spill_long(frame) and overflow.count == 2
    sampling = SamplingGate(Sampler(train=Policy(max_samples=1)), lambda record: None)
    stage._assembler._gate = sampling
    assert stage._assembler.samples_early
    assert not stage.spill_long(frame)  # the sampler decides on its headers first
    assert overflow.count == 2


def test_a_long_frame_that_is_not_ours_is_an_error_whatever_is_asked_of_it() -> None:
    """The capture process stops reading on it, as on any frame that is not ours."""
    junk = LongFrame((1, 4, 2, 2), bytearray(b'{"a"}xyzw'))
    with pytest.raises(ValueError):
        junk.decode()
    with pytest.raises(ValueError):
        junk.dropped  # noqa: B018
    not_an_exchange = LongFrame((1, 2, 0, 0), bytearray(b"[]"))
    with pytest.raises(ValueError):
        not_an_exchange.dropped  # noqa: B018


async def test_between_bursts_of_parsing_reading_comes_first(tmp_path: Path) -> None:
    """On a core the forwarder keeps busy, what the capture process gets goes to reading
    while anything is there to read: only what is not read in time is dropped, and what is
    read can wait in the queue, then on disk. Parsing goes on as soon as nothing waits to be
    read, when a `put` waits for room (only parsing makes it) or when a flush waits for
    parsing."""
    sent = rollouts(samples=8, turns=2)
    size = len(sent[-1].request_body) + len(sent[-1].response_body)
    stage, out, _, _ = stage_with_overflow(tmp_path, max_bytes=4 * (size + 600))
    to_read = [True]
    stage.unread = lambda: to_read[0]
    for item in sent[:8]:
        await asyncio.wait_for(stage.put(item), 5)
    overflow = stage._overflow
    assert overflow is not None and overflow.count > 0
    stage.start()
    for _ in range(20):
        await asyncio.sleep(0)
    assert stage._processed == 1, "parsed more than a burst while exchanges were to be read"
    putting = asyncio.ensure_future(asyncio.gather(*(stage.put(x) for x in sent[8:])))
    await asyncio.wait_for(putting, 10)  # the overflow was full: parsing made room
    assert stage._processed > 0 and to_read[0]
    await asyncio.wait_for(stage.drain(), 10)  # a flush waits for parsing: it goes on
    await stage.stop()
    built = sorted((r for r in out if isinstance(r, Trajectory)), key=lambda t: t.key.sample_index)
    assert [len(t.calls) for t in built] == [2] * 8


async def test_parsing_goes_on_once_nothing_is_left_to_read(tmp_path: Path) -> None:
    stage, _, _, _ = stage_with_overflow(tmp_path)
    to_read = [True]
    stage.unread = lambda: to_read[0]
    for item in rollouts(samples=5, turns=1):
        await stage.put(item)
    stage.start()
    for _ in range(20):
        await asyncio.sleep(0)
    assert stage._processed == 1  # one burst, then reading first
    to_read[0] = False
    caught_up = asyncio.ensure_future(stage.caught_up())
    await asyncio.wait_for(caught_up, 10)
    assert stage._processed == 5
    await stage.stop()


async def test_long_frames_read_into_buffers_given_back_are_the_frames_sent() -> None:
    """A long frame's buffer is reused for a later one, cut to its size: nothing of the
    earlier frame shows through, longer or shorter."""
    sent = [exchange(0, turn, list(range(n))) for turn, n in enumerate((900, 300, 1200, 50, 700))]
    reader = FrameReader(8, own_buffer_from=200, defer_long=True)
    reader.connection_made(_Transport())
    buffers = set()
    for item in sent:
        frame = b"".join(encode_exchange(item))
        reader.feed(frame[: HEAD.size + 4])
        reader.feed(frame[HEAD.size + 4 :])
        (long,) = reader._frames
        reader._frames.clear()
        assert isinstance(long, LongFrame)
        assert len(long.buffer) == len(frame) - HEAD.size
        assert fields(long.decode()) == fields(item)
        buffers.add(id(long.buffer))
        reader.give_back(long.buffer)
    assert len(buffers) < len(sent)  # some were reused


async def test_reading_first_never_holds_up_a_put_that_waits_for_a_full_queue() -> None:
    """Without an overflow (`--capture-overflow-bytes 0`) a `put` waits for the queue's room,
    which only parsing makes: however much waits to be read, parsing then goes on."""
    out: list[Record] = []
    assembler = Assembler(out.append, project="p", experiment="e", idle_timeout=60)
    stage = CaptureStage(MetadataResolver([]), assembler, Metrics(), project="p", experiment="e",
                         queue_size=2, idle_check_interval=60)  # fmt: skip
    stage.unread = lambda: True
    stage.start()
    sent = rollouts(samples=6, turns=2)
    for item in sent:
        await asyncio.wait_for(stage.put(item), 5)
    await asyncio.wait_for(stage.drain(), 5)
    await stage.stop()
    assert sorted(len(r.calls) for r in out if isinstance(r, Trajectory)) == [2] * 6
