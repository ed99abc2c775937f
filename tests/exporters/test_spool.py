"""The spool on disk: whole framed lines, numbering that survives restarts, torn tails and damaged
lines handled, a disk budget whose deletions are counted, one writer and one exporter per
directory (a leftover of a killed proxy waited for, a running proxy's spool refused)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_proxy.exporters import spool as spool_module
from trace_proxy.exporters.spool import (
    Cursor,
    CursorState,
    SpoolBusy,
    SpoolFull,
    SpoolLock,
    SpoolReader,
    SpoolWriter,
    acquire,
    backlog,
    check_not_in_use,
    release,
    segments,
)


def payloads(start: int, count: int, size: int = 0) -> list[bytes]:
    return [b'{"n":%d,"pad":"%s"}' % (i, b"x" * size) for i in range(start, start + count)]


def read_all(directory: Path, start: int = 0) -> tuple[list[tuple[int, bytes]], int, int]:
    reader = SpoolReader(directory)
    batch = reader.read(start, 10_000)
    reader.close()
    return batch.records, batch.missing, batch.corrupt


def test_records_are_numbered_in_order_and_read_back_from_any_position(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    assert spool.append(payloads(0, 3)) == 3
    assert spool.append(payloads(3, 2)) == 5
    records, missing, corrupt = read_all(tmp_path)
    assert records == list(enumerate(payloads(0, 5)))
    assert read_all(tmp_path, start=3)[0] == [(3, payloads(3, 1)[0]), (4, payloads(4, 1)[0])]
    assert (missing, corrupt) == (0, 0)


def test_numbering_resumes_after_a_restart_and_never_goes_behind_a_cursor(
    tmp_path: Path,
) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    spool.append(payloads(0, 4))
    spool.close()
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    assert spool.next_seq == 4
    spool.close()
    for _, path in segments(tmp_path):  # everything exported and released
        path.unlink()
    Cursor(tmp_path, "jsonl").save(CursorState(next=4))
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    assert spool.next_seq == 4  # numbering from 0 again would hide new records from jsonl
    spool.close()


def test_a_torn_tail_is_cut_and_a_damaged_line_is_counted(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    spool.append(payloads(0, 3))
    spool.close()
    [(_, path)] = segments(tmp_path)
    lines = path.read_bytes().split(b"\n")
    damaged = lines[1].replace(b'"n":1', b'"n":7')  # the checksum no longer matches
    path.write_bytes(b"\n".join([lines[0], damaged, lines[2]]) + b"\n3 0000")  # + torn tail
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    assert spool.next_seq == 3
    spool.append(payloads(3, 1))
    spool.close()
    records, missing, corrupt = read_all(tmp_path)
    assert [seq for seq, _ in records] == [0, 2, 3]
    assert (missing, corrupt) == (0, 1)


def test_a_reader_waits_for_a_line_still_being_written(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    spool.append(payloads(0, 1))
    [(_, path)] = segments(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole + b"1 ")  # the start of the next line
    reader = SpoolReader(tmp_path)
    assert [seq for seq, _ in reader.read(0, 10).records] == [0]
    assert reader.read(1, 10).records == []
    path.write_bytes(whole)
    spool.append(payloads(1, 1))
    assert [seq for seq, _ in reader.read(1, 10).records] == [1]
    reader.close()
    spool.close()


def test_lines_longer_than_a_read_or_across_reads_come_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader takes the segment in blocks: a line may start in one and end blocks later,
    or a block may end anywhere in a line, its checksum or its number."""
    monkeypatch.setattr(spool_module, "READ_BYTES", 16)
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    sizes = [0, 1, 2, 3, 5, 8, 13, 40, 200, 3, 1000, 0, 7]
    written = [payload for i, size in enumerate(sizes) for payload in payloads(i, 1, size)]
    spool.append(written[:6])
    reader = SpoolReader(tmp_path)
    first = reader.read(0, 4)  # stops inside the buffer, between lines
    spool.append(written[6:])
    rest = reader.read(first.next, 100)
    reader.close()
    spool.close()
    assert first.records + rest.records == list(enumerate(written))
    assert (rest.missing, rest.corrupt) == (0, 0)
    assert read_all(tmp_path, 9)[0] == list(enumerate(written))[9:]


def test_the_budget_deletes_the_oldest_segments_and_readers_count_the_gap(
    tmp_path: Path,
) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=4096, segment_bytes=1024)
    for i in range(40):
        spool.append(payloads(i, 1, size=200))
        assert spool.used_bytes <= 4096
    records, missing, corrupt = read_all(tmp_path)
    assert missing > 0 and corrupt == 0
    assert missing + len(records) == 40
    assert [seq for seq, _ in records] == list(range(missing, 40))
    with pytest.raises(SpoolFull):
        spool.append(payloads(40, 1, size=8192))
    spool.close()


def test_segments_are_released_once_every_backend_has_passed_them(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20, segment_bytes=256)
    for i in range(12):
        spool.append(payloads(i, 1, size=100))
    firsts = [first for first, _ in segments(tmp_path)]
    assert len(firsts) > 3
    Cursor(tmp_path, "fast").save(CursorState(next=12))
    Cursor(tmp_path, "slow").save(CursorState(next=firsts[2]))
    release(tmp_path, ["fast", "slow"])
    assert [first for first, _ in segments(tmp_path)] == firsts[2:]
    Cursor(tmp_path, "slow").save(CursorState(next=12))
    release(tmp_path, ["fast", "slow"])
    assert [first for first, _ in segments(tmp_path)] == firsts[-1:]  # the one being written
    spool.close()


def test_one_writer_per_spool_directory(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolBusy, match="another running trace-proxy"):
        SpoolWriter(tmp_path, max_bytes=1 << 20)
    spool.close()
    SpoolWriter(tmp_path, max_bytes=1 << 20).close()  # free again once the first one closed


def _finished_pid() -> int:
    """The pid of a process that has ended: stands for a proxy that was killed."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_spool_held_for_a_running_proxy_is_an_error_at_once(tmp_path: Path) -> None:
    other = os.getppid()  # running, and not us: stands for another proxy
    held = SpoolLock(tmp_path, "writer", proxy=other)
    assert held.try_acquire() is None
    message = rf"another running trace-proxy \(process {other}\)"
    with pytest.raises(SpoolBusy, match=message):
        check_not_in_use(tmp_path, os.getpid())
    with pytest.raises(SpoolBusy, match=message):  # not waited for
        asyncio.run(acquire(SpoolLock(tmp_path, "writer"), wait=60))
    held.release()
    check_not_in_use(tmp_path, os.getpid())


async def test_a_leftover_is_waited_for_a_bounded_time(tmp_path: Path) -> None:
    """The helpers of a killed proxy still hold the lock while they finish: a new proxy waits
    for them (saying so), then has it; past its bound, SpoolBusy."""
    leftover = SpoolLock(tmp_path, "export", proxy=_finished_pid())
    assert leftover.try_acquire() is None
    check_not_in_use(tmp_path, os.getpid())  # not an error: it will be gone
    told: list[str] = []
    waiting = asyncio.Event()

    def on_wait(why: str) -> None:
        told.append(why)
        waiting.set()

    ours = SpoolLock(tmp_path, "export")
    taking = asyncio.ensure_future(acquire(ours, wait=60, on_wait=on_wait))
    await asyncio.wait_for(waiting.wait(), 10)
    assert not taking.done() and not ours.held
    assert told == [f"waiting for process {os.getpid()}, left by an earlier trace-proxy, to "
                    "finish with the spool (at most 60 s)"]  # fmt: skip
    leftover.release()
    await asyncio.wait_for(taking, 10)
    assert ours.held

    ours.release()

    stuck = SpoolLock(tmp_path, "export", proxy=_finished_pid())
    assert stuck.try_acquire() is None
    with pytest.raises(SpoolBusy, match=r"still held by process \d+ after 0 s"):
        await acquire(SpoolLock(tmp_path, "export"), wait=0.2)
    stuck.release()


def test_backlog_counts_what_each_backend_has_not_exported(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path, max_bytes=1 << 20)
    end = spool.append(payloads(0, 5))
    Cursor(tmp_path, "fast").save(CursorState(5))
    Cursor(tmp_path, "slow").save(CursorState(2))
    assert backlog(tmp_path, ["fast", "slow", "new"], end) == {"fast": 0, "slow": 3, "new": 5}
    spool.close()
