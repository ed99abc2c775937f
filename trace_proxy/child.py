"""Helper processes of the proxy (capture, export): how they are started, reached and reaped.

Each is a fresh interpreter (`python -m MODULE FD`), not a fork: the parent's threads, sockets
and event loop are not inherited. The parent keeps one end of a socket pair; the child gets the
other as FD, and reads its start-up payload (pickled settings) from it before anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from collections.abc import Coroutine
from typing import Any

import orjson

from trace_proxy.config import ConfigError
from trace_proxy.trajectories.token2text import TokenizerError

log = logging.getLogger(__name__)
NICENESS = 19  # priority low, or idle where SCHED_IDLE is missing
# A helper allocates a few containers per token list and record (decoded JSON, dataclasses),
# nearly all freed by reference counting; at the default of 700 allocations a young
# collection ran hundreds of times a second. Full collections scan every open trajectory.
YOUNG_COLLECTION_EVERY = 20_000
_LENGTH = struct.Struct("!I")


async def spawn(
    module: str, payload: Any, *, limit: int = 1 << 24, buffer_bytes: int | None = None
) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.StreamWriter]:
    """Start `module`'s child with `payload`; its socket as a reader and a writer."""
    ours, theirs = socket.socketpair()
    if buffer_bytes is not None:  # fewer round trips through user space for large frames
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    data = pickle.dumps(payload)
    ours.sendall(_LENGTH.pack(len(data)) + data)  # small: fits the socket buffer
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, str(theirs.fileno()), pass_fds=[theirs.fileno()]
        )
    finally:
        theirs.close()
    reader, writer = await asyncio.open_connection(sock=ours, limit=limit)
    return process, reader, writer


def receive_payload(fd: int) -> tuple[socket.socket, Any]:
    """In the child, before its event loop starts: its socket and the start-up payload."""
    sock = socket.socket(fileno=fd)
    data = b""
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack(data[:4])[0]:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise SystemExit("the proxy went away before its helper process started")
        data += chunk
    size = _LENGTH.unpack(data[:4])[0]
    return sock, pickle.loads(data[4 : 4 + size])


def lower_priority(priority: str) -> None:
    """In the child: idle runs only on CPU time nothing else wants (Linux SCHED_IDLE, inherited
    by every thread made after this; nice 19 where it is missing); low is nice 19; normal keeps
    the parent's. A helper that lags is better than forwarding that waits."""
    if priority == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    if priority in ("idle", "low"):
        with contextlib.suppress(OSError):
            os.nice(NICENESS)


def tune_gc() -> None:
    """Fewer cyclic collections: what the imports made is never collected again (frozen), and a
    young collection waits for YOUNG_COLLECTION_EVERY allocations. With the defaults, 5-10% of
    the capture process's CPU went to collections when we profiled it."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, old)


def run_child(serve: Coroutine[Any, Any, None], priority: str, log_level: str) -> None:
    """The rest of a helper's life: signals are its parent's to act on (it stops when asked,
    or when its socket closes), its CPU priority, logging, then `serve` under uvloop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lower_priority(priority)
    tune_gc()
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trace_proxy").setLevel(log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(serve)
    else:
        uvloop.run(serve)


async def reap(process: asyncio.subprocess.Process | None, writer: asyncio.StreamWriter | None,
               grace: float = 10.0) -> None:  # fmt: skip
    """Close our end, give the child `grace` seconds to leave, then kill it."""
    if writer is not None:
        writer.close()
    if process is not None:
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            process.kill()
            await process.wait()


class Helper:
    """The parent's side of one helper process: start it, listen to it, start another when it
    dies, stop it. Subclasses say what to send and what the child's other messages mean.

    The child answers on its socket with JSON lines: `ready` or `error` (at start; `kind`
    tokenizer or config), `discovered` (token2text found the served tokenizers), `stopped`;
    anything else goes to `_on_message`.
    """

    name = "helper process"
    start_timeout = 300.0
    restart_delay = 1.0

    def __init__(self, module: str, payload: Any, buffer_bytes: int | None = None) -> None:
        self._module = module
        self._payload = payload
        self._buffer_bytes = buffer_bytes
        self._ready: asyncio.Future[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self.tokenizer_discovery: asyncio.Future[None] | None = None  # made in start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Raises ConfigError or TokenizerError as the child reports them."""
        self.tokenizer_discovery = asyncio.get_running_loop().create_future()
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _stop(self, message: bytes, timeout: float) -> None:
        """Send the child its stop message and give it `timeout` seconds to say `stopped`."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        writer, stopped = self._writer, self._stopped
        if writer is not None and stopped is not None and not stopped.done():
            writer.write(message)
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                await asyncio.wait_for(asyncio.shield(stopped), timeout)
        await reap(self._process, self._writer)

    # --- hooks ---

    def _on_message(self, op: str, message: dict[str, Any]) -> None:
        log.warning("the %s sent an unknown message %r", self.name, op)

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
        self._stopped = loop.create_future()
        listener = loop.create_task(self._listen(reader))
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout)
        except BaseException:
            listener.cancel()
            await reap(self._process, self._writer)
            raise
        self._started()

    async def _supervise(self) -> None:
        while not self._stopping:
            assert self._stopped is not None
            await asyncio.shield(self._stopped)
            if self._stopping:
                return
            log.error("the %s ended unexpectedly (exit code %s); starting another", self.name,
                      self._process.returncode if self._process else None)  # fmt: skip
            self._died()
            await reap(self._process, self._writer)
            await asyncio.sleep(self.restart_delay)
            try:
                await self._spawn()
            except Exception:
                log.exception("the %s cannot start again", self.name)
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
