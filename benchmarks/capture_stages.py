"""Where the capture process's CPU goes, stage by stage, per recorded exchange.

    python benchmarks/capture_stages.py [--prompt-tokens 1024,8192,32768] [--rounds 5]

The exchanges are the benchmark workload's (vLLM `/v1/completions`, token-id prompts, 4-turn
trajectories), framed as the forwarder frames them and sent over a socket pair from another
process as fast as they are read. This process is a capture process: its own `FrameReader` and
a `Recorder` writing every trajectory to a spool, with its garbage-collector and malloc
settings. Nothing else runs on its loop, so each figure is that work alone, free of the
forwarder and load generator that share the cores in `recording_cost.py` (whose per-process
figures are this plus that contention).

Each stage's CPU is the thread time spent in one function, summed over the run:

- request: `decode_request`, the request body to a dict (prompt ids kept as their JSON text
  where they continue the trajectory's last prompt), less the next stage, which it calls;
- key fields: `CaptureStage._latest_prompt`, the call's metadata from its headers and the
  latest prompt of the trajectory it names;
- response: the dialect's parser, the response body to the call's outputs;
- assembler: `Assembler.add_call`, the call into its trajectory, its prompt's prefix shared;
- closing: `Assembler.run_pending`, closed trajectories built, sampled and handed to the spool;
- the rest of the main thread: frames taken apart, the capture queue, the loop;
- the spool writer's thread: records encoded, checksummed and written.

"Without decoding" is what would remain if both bodies cost nothing to decode and parse: the
total less request and response. Prints a markdown table: the round with the least CPU of each
prompt size, and the median total over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib.frames import sent_by_another_process  # noqa: E402

import trace_proxy.capture.dispatch as dispatch_module  # noqa: E402
from trace_proxy.capture.exchange import Exchange  # noqa: E402
from trace_proxy.capture.wire import FrameReader, LongFrame  # noqa: E402
from trace_proxy.config import Settings  # noqa: E402
from trace_proxy.metrics import Metrics  # noqa: E402
from trace_proxy.processes.helper import tune_gc, tune_malloc  # noqa: E402
from trace_proxy.processes.recorder import Recorder  # noqa: E402
from trace_proxy.trajectories.assembler import Assembler  # noqa: E402

EXCHANGES = {1024: 2048, 8192: 1024, 32768: 256}  # per round: whole trajectories, some steps
COLUMNS = ("request", "key fields", "response", "assembler", "closing")


@dataclasses.dataclass
class Round:
    exchanges: int
    total: float  # process CPU, user + system, seconds
    main: float  # the loop's thread
    stages: dict[str, float]

    def per(self, seconds: float) -> str:
        return f"{seconds / self.exchanges * 1e6:.0f}"


class StageClock:
    """Thread CPU time spent inside wrapped functions, by stage."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys((*COLUMNS, "decode"), 0.0)

    def wrap(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        spent, clock = self.spent, time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent[stage] += clock() - began

        return timed

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The stages' functions wrapped where the capture stage and assembler look them up."""
        saved = (
            dispatch_module.decode_request,
            dispatch_module.DIALECTS,
            dispatch_module.Dispatcher._latest_prompt,
            Assembler.add_call,
            Assembler.run_pending,
        )
        dispatch_module.decode_request = self.wrap("decode", saved[0])
        dispatch_module.DIALECTS = {
            path: (name, self.wrap("response", parser)) for path, (name, parser) in saved[1].items()
        }
        dispatch_module.Dispatcher._latest_prompt = self.wrap("key fields", saved[2])
        Assembler.add_call = self.wrap("assembler", saved[3])
        Assembler.run_pending = self.wrap("closing", saved[4])
        try:
            yield
        finally:
            (
                dispatch_module.decode_request,
                dispatch_module.DIALECTS,
                dispatch_module.Dispatcher._latest_prompt,
                Assembler.add_call,
                Assembler.run_pending,
            ) = saved

    def stages(self) -> dict[str, float]:
        result = {name: self.spent[name] for name in COLUMNS}
        result["request"] = self.spent["decode"] - self.spent["key fields"]
        return result


async def record_all(sock: Any, output: Path, count: int) -> Round:
    """Read `count` exchanges as the capture process does and record them all to the spool."""
    settings = dataclasses.replace(
        Settings(), upstream=["http://127.0.0.1:9"], output=output, port=0, admin_port=0
    )
    recorder = Recorder(settings, Metrics(), [])  # no backend: the spool is the end
    await recorder.start()
    loop = asyncio.get_running_loop()
    _, reader = await loop.create_connection(partial(FrameReader, defer_long=True), sock=sock)
    clock = StageClock()
    with clock.installed():
        before, main_before = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        for _ in range(count):
            frame = await reader.next()
            if isinstance(frame, LongFrame):  # as the capture process takes one in
                long, frame = frame, frame.decode()
                reader.give_back(long.buffer)
            if not isinstance(frame, Exchange) or not recorder.admit(frame):
                raise RuntimeError(f"not an exchange the capture stage takes: {frame!r}")
            await recorder.capture.put(frame)
        await recorder.capture.drain()
        await recorder.pipeline.flush()
        after, main_after = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
    await recorder.stop(10)
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Round(count, total, main_after - main_before, clock.stages())


def one_round(prompt_tokens: int, count: int) -> Round:
    with sent_by_another_process(prompt_tokens, count) as ours:
        with tempfile.TemporaryDirectory() as output:
            return asyncio.run(record_all(ours, Path(output), count))


def row(tokens: int, best: Round, median_total: float) -> str:
    stages = best.stages
    rest = best.main - sum(stages.values())
    decoding = stages["request"] + stages["response"]
    cells = [
        f"{tokens}",
        f"{best.per(best.total)} (median {median_total / best.exchanges * 1e6:.0f})",
        *(best.per(stages[name]) for name in COLUMNS),
        best.per(rest),
        best.per(best.total - best.main),
        f"{best.per(best.total - decoding)} ({1 - decoding / best.total:.0%})",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", default="1024,8192,32768")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--exchanges", type=int, default=None, help="per round")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    tune_malloc()
    tune_gc()
    print(
        "| prompt tokens | CPU per exchange (µs) | request | key fields | response | assembler"
        " | closing | rest of main thread | spool writer thread | without decoding |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.prompt_tokens.split(",")):
        count = args.exchanges or EXCHANGES.get(tokens, 512)
        count = max(4, count - count % 4)  # whole trajectories
        rounds = [one_round(tokens, count) for _ in range(args.rounds)]
        best = min(rounds, key=lambda r: r.total)
        print(row(tokens, best, statistics.median(r.total for r in rounds)), flush=True)


if __name__ == "__main__":
    main()
