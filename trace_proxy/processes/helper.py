"""Helper processes of the proxy (capture, export): how they are started, reached and reaped.

Each is a fresh interpreter (`python -m MODULE FD`), not a fork: the parent's threads, sockets
and event loop are not inherited. The parent keeps one end of a socket pair; the child gets the
other as FD, and reads its start-up payload (pickled settings) from it before anything else.

Start-up is not waited for: the socket exists from the moment the child is spawned, so what the
parent writes waits in it until the child reads, and the parent's `Helper` reports the child's
state (`check`) for /ready instead of holding up the proxy. Helpers are spawned from a thread
that keeps the process's own CPU priority (`spawner`), so a helper that lowers its own (the
capture process) still starts the export process at the proxy's priority.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import orjson

from trace_proxy.config import ConfigError
from trace_proxy.logtext import configure_logging
from trace_proxy.processes import lifeline
from trace_proxy.processes.lifeline import TERM_BOUND, Lifeline
from trace_proxy.text.token2text import TokenizerError

log = logging.getLogger(__name__)
NICENESS = 19  # priority low, or idle where SCHED_IDLE is missing
# A helper allocates a few containers per token list and record (decoded JSON, dataclasses),
# nearly all freed by reference counting; at the default of 700 allocations a young
# collection ran hundreds of times a second. Full collections scan every open trajectory.
YOUNG_COLLECTION_EVERY = 20_000
# mallopt's parameters (malloc.h) and what a helper sets them to (see `tune_malloc`).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD = 64 << 20
SLOW_START = 60.0  # seconds after which a helper still starting is worth a warning
MAX_RESTART_DELAY = 30.0
PER_THREAD_PRIORITY = sys.platform.startswith("linux")  # else nice and policy are per process
_LENGTH = struct.Struct("!I")
_PR_SET_NAME = 15
_proxy_pid: int | None = None  # in a helper: the pid of the proxy's main process


def proxy_pid() -> int:
    """The pid of this proxy's main process (this process's own, outside helpers)."""
    return os.getpid() if _proxy_pid is None else _proxy_pid


# --- the parent's side: spawning -----------------------------------------------------------


class _Spawner:
    """A thread that starts child processes. It is made before a helper lowers its own CPU
    priority, which its children would inherit otherwise (priority is per thread on Linux), and
    lives as long as the process (the kernel's parent-death signal follows the thread)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="spawner", daemon=True).start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    def _run(self) -> None:
        while True:
            future, job = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:
                    future.set_exception(exc)


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
        return _spawner


class HelperProcess:
    """A started helper: its pid, its exit (awaitable), and signals to it."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[int] = loop.create_future()
        threading.Thread(target=self._wait, args=(loop,), name="reaper", daemon=True).start()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(sig)

    def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self._popen.wait()
        lifeline.disown(self.pid)
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(_settle, self._exited, code)


def _settle(future: asyncio.Future[int], code: int) -> None:
    if not future.done():
        future.set_result(code)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def spawn(
    module: str, payload: Any, *, limit: int = 1 << 24, buffer_bytes: int | None = None
) -> tuple[HelperProcess, asyncio.StreamReader, asyncio.StreamWriter]:
    """Start `module`'s child with `payload`; its socket as a reader and a writer."""
    ours, theirs = socket.socketpair()
    if buffer_bytes is not None:  # fewer round trips through user space for large frames
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    data = pickle.dumps((os.getpid(), proxy_pid(), payload))
    ours.sendall(_LENGTH.pack(len(data)) + data)  # small: fits the socket buffer
    command = [sys.executable, "-m", module, str(theirs.fileno())]
    try:
        popen = await asyncio.wrap_future(
            spawner().submit(lambda: subprocess.Popen(command, pass_fds=[theirs.fileno()]))
        )
    finally:
        theirs.close()
    lifeline.adopt(popen.pid)
    process = HelperProcess(popen, asyncio.get_running_loop())
    reader, writer = await asyncio.open_connection(sock=ours, limit=limit)
    return process, reader, writer


async def reap(process: HelperProcess | None, writer: asyncio.StreamWriter | None,
               grace: float = 10.0) -> None:  # fmt: skip
    """Close our end, give the child `grace` seconds to leave, then SIGTERM (it leaves within
    TERM_BOUND), then kill it."""
    if writer is not None:
        writer.close()
    if process is None:
        return
    for wait, end in ((grace, process.terminate), (TERM_BOUND + 0.5, process.kill)):
        try:
            await asyncio.wait_for(process.wait(), wait)
            return
        except asyncio.TimeoutError:
            end()
    await process.wait()


# --- the child's side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """What a helper is given: its socket, its parent's pid and its payload."""

    sock: socket.socket
    parent: int
    payload: Any


def receive_payload(fd: int) -> Started:
    """In the child, before its event loop starts: its socket and the start-up payload."""
    global _proxy_pid
    sock = socket.socket(fileno=fd)
    (size,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    parent, _proxy_pid, payload = pickle.loads(_read_exactly(sock, size))
    return Started(sock, parent, payload)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """Not a byte more: what follows the payload is the parent's first messages, which it
    may write before the child is up."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise SystemExit("the proxy went away before its helper process started")
        data += chunk
    return data


def lower_priority(priority: str) -> None:
    """In the child: idle runs only on CPU time nothing else wants (Linux SCHED_IDLE; nice 19
    where it is missing); low is nice 19; normal keeps the parent's. A helper that lags is
    better than forwarding that waits. On Linux this is the calling thread's priority, and
    every thread it makes after this inherits it."""
    if priority == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    if priority in ("idle", "low"):
        with contextlib.suppress(OSError):
            os.nice(NICENESS)


def name_thread() -> None:
    """A working thread's name where `top -H` and /proc show it (Linux; a ThreadPoolExecutor
    initializer)."""
    if PER_THREAD_PRIORITY:
        with contextlib.suppress(OSError, AttributeError):
            name = threading.current_thread().name.encode()[:15]
            ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def lower_thread(priority: str) -> None:
    """A working thread's first step: its name, and the helper's priority for it alone."""
    name_thread()
    lower_priority(priority)


def tune_gc() -> None:
    """Fewer cyclic collections: what the imports made is never collected again (frozen), and a
    young collection waits for YOUNG_COLLECTION_EVERY allocations. With the defaults, 5-10% of
    the capture process's CPU went to collections when we profiled it."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, old)


def tune_malloc() -> None:
    """Freed memory kept for the next body instead of given back to the kernel (glibc's
    malloc; nothing elsewhere). Bodies of 8k- and 32k-token prompts (50-800 kB) are at or above
    its default threshold for mapping an allocation on its own, and what it frees at the heap's
    top goes back to the kernel past twice that: the capture process's copies of each body went
    to fresh pages, 130 page faults per 32k-token call, measured. Allocations under 32 MiB now
    come from the heap, which keeps up to 64 MiB it no longer uses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def run_helper(
    serve: Callable[[Lifeline], Coroutine[Any, Any, None]],
    started: Started,
    *,
    name: str,
    priority: str,
    log_level: str,
    grace: float,
    whole_process: bool = True,
) -> None:
    """The rest of a helper's life: SIGINT is its parent's to act on; SIGTERM and its parent's
    death end it within a bound (`lifeline.py`); its CPU priority (for the whole process, or,
    with `whole_process=False` where threads have their own, left to the threads that do the
    work), logging, then `serve` under uvloop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    life = Lifeline(name, started.parent, grace)
    life.watch()  # before any other thread: they inherit its signal mask
    spawner()  # before lowering: the helpers it starts keep the proxy's priority
    if whole_process or not PER_THREAD_PRIORITY:
        lower_priority(priority)
    tune_gc()
    tune_malloc()
    configure_logging("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(serve(life))
    else:
        uvloop.run(serve(life))


# --- the parent's side: one helper ---------------------------------------------------------


class Helper:
    """The parent's side of one helper process: start it, listen to it, start another when it
    dies, stop it. Subclasses say what to send and what the child's other messages mean.

    The child answers on its socket with JSON lines: `starting` (what it waits for), `ready`
    or `error` (at start; `kind` tokenizer or config), `discovered` (token2text found the
    served tokenizers), `stopped`; anything else goes to `_on_message`. `start` does not wait
    for `ready`: `check` says where the child is, `failure` is set when it cannot start at
    all (a configuration error, which would repeat: the proxy ends on it)."""

    name = "helper process"
    restart_delay = 1.0
    # Whether a child asked to stop before it is ready is sent SIGTERM (it holds nothing yet)
    # rather than its stop message (it reads that once ready).
    terminate_while_starting = False

    def __init__(self, module: str, payload: Any, buffer_bytes: int | None = None) -> None:
        self._module = module
        self._payload = payload
        self._buffer_bytes = buffer_bytes
        self._ready: asyncio.Future[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._process: HelperProcess | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self.state = "not started"  # starting, ready, restarting, failed, stopped
        self.detail = ""
        self.failure: asyncio.Future[BaseException] | None = None  # made in start()
        self.tokenizer_discovery: asyncio.Future[None] | None = None  # made in start()
        self.on_change: Callable[[], None] | None = None
        self._changed = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def check(self) -> str:
        """`ok` when ready; else what it is doing, for /ready."""
        if self.state == "ready":
            return "ok"
        if self.state == "starting":
            doing = f": {self.detail}" if self.detail else ""
            return f"starting (process {self.pid}){doing}"
        return f"{self.state}: {self.detail}" if self.detail else self.state

    async def start(self) -> None:
        """Spawn the child and return; it starts in the background (see `check`, `failure`,
        `wait_ready`). Raises OSError when no process can be started at all."""
        loop = asyncio.get_running_loop()
        self.tokenizer_discovery = loop.create_future()
        self.failure = loop.create_future()
        await self._spawn()
        self._supervisor = loop.create_task(self._supervise())

    async def wait_ready(self) -> None:
        """Until the child is ready; raises what keeps it from starting."""
        assert self.failure is not None, "start() first"
        while not self.ready:
            if self.failure.done():
                raise self.failure.result()
            if self.state in ("failed", "stopped"):
                raise RuntimeError(f"the {self.name}: {self.check}")
            self._changed.clear()
            await self._changed.wait()

    async def _stop(self, message: bytes, timeout: float) -> None:
        """Send the child its stop message and give it `timeout` seconds to say `stopped`."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        writer, stopped = self._writer, self._stopped
        if self.terminate_while_starting and not self.ready and self._process is not None:
            self._process.terminate()  # nothing to finish: what it would export is spooled
        elif writer is not None and stopped is not None and not stopped.done():
            writer.write(message)
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                await asyncio.wait_for(asyncio.shield(stopped), timeout)
        await reap(self._process, self._writer)
        self._set_state("stopped", "")

    def _fail(self, error: BaseException) -> None:
        """A start-up error the child reported: the proxy cannot run as configured."""
        self._set_state("failed", str(error))
        if self.failure is not None and not self.failure.done():
            self.failure.set_result(error)

    def _set_state(self, state: str, detail: str) -> None:
        self.state, self.detail = state, detail
        self._changed.set()
        if self.on_change is not None:
            self.on_change()

    # --- hooks ---

    def _on_message(self, op: str, message: dict[str, Any]) -> None:
        log.warning("the %s sent an unknown message %r", self.name, op)

    def _connected(self) -> None:
        """A child was spawned: its socket takes messages from now on (read once it is up)."""

    def _started(self) -> None:
        """The child is ready (again): send it what it needs to know."""

    def _died(self) -> None:
        """The child ended unexpectedly; another starts after this."""

    # --- the child's lifecycle ---

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        self._process, reader, self._writer = await spawn(
            self._module, self._payload, buffer_bytes=self._buffer_bytes
        )
        self._ready = loop.create_future()
        self._ready.add_done_callback(_retrieved)  # seen by the supervisor, or by nobody
        self._stopped = loop.create_future()
        self._listener = loop.create_task(self._listen(reader))
        self._set_state("starting", "")
        self._connected()

    async def _supervise(self) -> None:
        delay = self.restart_delay
        while not self._stopping:
            assert self._ready is not None and self._stopped is not None
            try:
                try:
                    await asyncio.wait_for(asyncio.shield(self._ready), SLOW_START)
                except asyncio.TimeoutError:
                    log.warning("the %s (process %s) has not started after %.0f s (busy cores? "
                                "see /ready); forwarding goes on, records wait in the spool",
                                self.name, self.pid, SLOW_START)  # fmt: skip
                    await asyncio.shield(self._ready)
            except (ConfigError, TokenizerError) as exc:  # would be the same the next time
                self._fail(exc)
                await reap(self._process, self._writer)
                return
            except RuntimeError:
                pass  # it ended while starting: started again below
            else:
                self._set_state("ready", "")
                self._started()
                delay = self.restart_delay
                await asyncio.shield(self._stopped)
            if self._stopping:
                return
            self._died()
            await reap(self._process, self._writer)
            code = self._process.returncode if self._process else None
            log.error("the %s ended unexpectedly (exit code %s); starting another in %.0f s",
                      self.name, code, delay)  # fmt: skip
            self._set_state("restarting", f"it ended with exit code {code}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RESTART_DELAY)  # until one starts: a crash loop is slow
            if self._stopping:
                return
            try:
                await self._spawn()
            except Exception as exc:
                log.exception("the %s cannot start again", self.name)
                self._set_state("failed", f"cannot start again: {exc}")
                return

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        assert self._ready is not None and self._stopped is not None
        ready, stopped = self._ready, self._stopped
        try:
            while line := await reader.readline():
                message = orjson.loads(line)
                op = message.get("op")
                if op == "ready":
                    ready.set_result(None)
                elif op == "starting":
                    self._set_state("starting", str(message.get("detail", "")))
                elif op == "error":
                    error = TokenizerError if message.get("kind") == "tokenizer" else ConfigError
                    ready.set_exception(error(message["message"]))
                    return
                elif op == "discovered":
                    discovery = self.tokenizer_discovery
                    if discovery is not None and not discovery.done():
                        discovery.set_result(None)
                elif op == "stopped":
                    return
                else:
                    self._on_message(op, message)
        except (ConnectionError, orjson.JSONDecodeError) as exc:
            log.error("lost the %s: %s", self.name, exc)
        finally:
            if not ready.done():
                ready.set_exception(RuntimeError(f"the {self.name} ended while starting"))
            if not stopped.done():
                stopped.set_result(None)
