"""What a capture process that is behind spends to take exchanges in, and how many it keeps
beside a busy forwarder.

    python benchmarks/intake.py [--prompt-tokens 8192,32768] [--frames 1500] [--rounds 5]
    python benchmarks/intake.py --rate 700 --busy 0.7 [--seconds 4] [--prompt-tokens 32768]

The exchanges are the benchmark workload's (vLLM `/v1/completions`, token-id prompts, 4-turn
trajectories), framed as the forwarder frames them and sent over a socket pair from another
process. The reader is the capture process's own loop: `FrameReader`, then a `CaptureStage`
with an overflow on disk. Run it against another revision with `PYTHONPATH` set to a worktree
of it: the script uses what that version has. Prints a markdown table; writes nothing.

Without `--rate`: the CPU the reader spends per exchange (user and system, `getrusage`) to read
it and leave it on disk, parsing not started (its queue holds one exchange), the writer sending
as fast as it is read. Median of the rounds.

With `--rate R --busy F` (Linux, 2 CPUs or more): the one-core sidecar. The writer stands in for
the forwarder: R exchanges a second for `--seconds`, never waiting; past half of
`--capture-queue-bytes` waiting in its buffer, an exchange is dropped and counted, as the
forwarder does. The reader runs at nice 19 on a CPU where a process at nice 0 is busy a
fraction F of every 10 ms (forwarding's use of the core), parsing as the capture process does,
its queue as configured by default. Reported per round: exchanges dropped, and how many of
those taken in were parsed by the time the writer was done.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib.frames import capture_socket, exchange, sent_by_another_process  # noqa: E402
from benchlib.workload import build_turns  # noqa: E402

import trace_proxy  # noqa: E402
from trace_proxy.capture import wire  # noqa: E402
from trace_proxy.capture.metadata import MetadataResolver  # noqa: E402
from trace_proxy.capture.overflow import Overflow  # noqa: E402
from trace_proxy.capture.stage import CaptureStage  # noqa: E402
from trace_proxy.config import Settings  # noqa: E402
from trace_proxy.metrics import Metrics  # noqa: E402
from trace_proxy.trajectories.assembler import Assembler  # noqa: E402


class _Sink(asyncio.Protocol):
    pass


def forward_at(
    sock: socket.socket, prompt_tokens: int, rate: float, seconds: float, cpu: int,
    answer: Connection,
) -> None:  # fmt: skip
    """R exchanges a second, never waiting; dropped past the forwarder's buffer limit."""
    os.sched_setaffinity(0, {cpu})
    turns = build_turns(4, False, 1, prompt_tokens)
    limit = Settings().capture_queue_bytes // 2

    async def run() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(_Sink, sock=sock)
        sent = dropped = 0
        started = loop.time()
        while (now := loop.time() - started) < seconds:
            due = int(now * rate)
            while sent + dropped < due:
                item = exchange(turns, sent + dropped)
                size = len(item.request_body) + len(item.response_body)
                buffered = transport.get_write_buffer_size()
                if buffered and buffered + size > limit:
                    dropped += 1
                else:
                    transport.writelines(wire.encode_exchange(item))
                    sent += 1
            await asyncio.sleep(0.001)
        while transport.get_write_buffer_size():
            await asyncio.sleep(0.01)
        transport.close()
        return sent, dropped

    answer.send(asyncio.run(run()))


def busy(share: float, cpu: int) -> None:
    """Busy `share` of every 10 ms on `cpu`, at nice 0: forwarding's use of the core."""
    os.sched_setaffinity(0, {cpu})
    while True:
        until = time.perf_counter() + share * 0.01
        while time.perf_counter() < until:
            pass
        time.sleep((1 - share) * 0.01)


async def read(sock: socket.socket, spool: Path, parse: bool) -> tuple[float, int, int]:
    """Take exchanges in until the writer is done: (CPU seconds, exchanges, parsed)."""
    loop = asyncio.get_running_loop()
    deferring = hasattr(wire, "LongFrame")  # a version that takes long frames in undecoded
    factory: Any = (lambda: wire.FrameReader(defer_long=True)) if deferring else wire.FrameReader
    _, reader = await loop.create_connection(factory, sock=sock)
    settings = Settings()
    assembler = Assembler(lambda record: None, project="p", experiment="e", idle_timeout=600)
    stage = CaptureStage(MetadataResolver([]), assembler, Metrics(), project="p",
                         experiment="e", queue_size=settings.capture_queue if parse else 1,
                         queue_bytes=settings.capture_queue_bytes // 2 if parse else 1 << 30,
                         idle_check_interval=600, overflow=Overflow(spool, 1 << 40))  # fmt: skip
    if parse:
        stage.start()
        if hasattr(reader, "unread"):
            stage.unread = reader.unread
    before = resource.getrusage(resource.RUSAGE_SELF)
    taken = 0
    while True:
        try:
            frame = await reader.next()
        except EOFError:
            break
        taken += 1
        if deferring and isinstance(frame, wire.LongFrame):
            long, frame = frame, None
            if not stage.spill_long(long):
                frame = long.decode()
            reader.give_back(long.buffer)
            if frame is None:
                continue
        await stage.put(frame)
    after = resource.getrusage(resource.RUSAGE_SELF)
    parsed = stage._processed
    await stage.stop(0)  # what is left is not parsed: counted, not waited for
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, taken, parsed


def cpu_round(prompt_tokens: int, count: int) -> float:
    with sent_by_another_process(prompt_tokens, count) as ours:
        with tempfile.TemporaryDirectory() as spool:
            cpu, taken, _ = asyncio.run(read(ours, Path(spool), parse=False))
    return cpu / taken * 1e6


def busy_round(prompt_tokens: int, rate: float, share: float, seconds: float) -> str:
    reader_cpu, writer_cpu = sorted(os.sched_getaffinity(0))[:2]
    fork = multiprocessing.get_context("fork")
    hog = fork.Process(target=busy, args=(share, reader_cpu), daemon=True)
    hog.start()  # before the socket exists: it must not hold the writer's end open
    ours, theirs = capture_socket()
    answer, answering = fork.Pipe(duplex=False)
    writer = fork.Process(
        target=forward_at,
        args=(theirs, prompt_tokens, rate, seconds, writer_cpu, answering),
    )
    writer.start()
    theirs.close()
    affinity = os.sched_getaffinity(0)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    os.sched_setaffinity(0, {reader_cpu})
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        with tempfile.TemporaryDirectory() as spool:
            _, taken, parsed = asyncio.run(read(ours, Path(spool), parse=True))
        sent, dropped = answer.recv()
    finally:
        os.sched_setaffinity(0, affinity)
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
        hog.kill()
        writer.join()
    assert taken == sent, (taken, sent)
    return f"{dropped} of {sent + dropped} dropped, {parsed} parsed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", default="8192,32768")
    parser.add_argument("--frames", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--busy", type=float, default=0.7)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # what a stop leaves unparsed is counted, and said so
    source = Path(trace_proxy.__file__).resolve().parent.parent
    print(f"trace_proxy from {source}\n")
    if args.rate is None:
        print("| prompt tokens | CPU per exchange taken in (µs), median | rounds |")
        print("|---|---|---|")
        for tokens in (int(t) for t in args.prompt_tokens.split(",")):
            runs = [cpu_round(tokens, args.frames) for _ in range(args.rounds)]
            spread = ", ".join(f"{r:.0f}" for r in runs)
            print(f"| {tokens} | {statistics.median(runs):.0f} | {spread} |")
        return
    print(f"| prompt tokens | {args.rate:g}/s for {args.seconds:g} s, beside a core "
          f"{args.busy:.0%} busy: each round |")  # fmt: skip
    print("|---|---|")
    for tokens in (int(t) for t in args.prompt_tokens.split(",")):
        runs = [busy_round(tokens, args.rate, args.busy, args.seconds)
                for _ in range(args.rounds)]  # fmt: skip
        print(f"| {tokens} | {'; '.join(runs)} |")


if __name__ == "__main__":
    main()
