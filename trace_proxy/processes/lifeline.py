"""How a helper process ends: when its parent asks, on SIGTERM, or when its parent is gone;
always within a bound.

A helper (capture, export) holds work only it can finish: exchanges not parsed yet, open
trajectories, records not exported yet. Its parent normally asks it to stop, over their socket.
If the parent is killed, the helper finishes what it holds within the shutdown grace and exits
(within ORPHAN_SLACK more, whatever it is doing). SIGTERM asks it to finish within TERM_GRACE;
it is gone within TERM_BOUND. Before it holds anything, either ends it at once.

A helper hears of its parent's death at once on Linux (PR_SET_PDEATHSIG sends it SIGHUP) and
elsewhere within PARENT_POLL seconds (its parent pid changes); a closed socket says the same.
Signals are taken by a thread of its own (`sigtimedwait`), so a helper busy importing an SDK,
or whose event loop is blocked, still hears them; past the deadline that thread ends the
process, and the helper processes it started with it.

A proxy started detached by another process (processes/detach.py, `--lifeline-fd`) hears of
that process's death the same way a helper does from its socket: the pipe it was given reads
end of file (`watch_pipe`). It then drains as on SIGTERM, and `exit_by` bounds it: past
`orphan_bound` it exits, and its helpers, seeing it gone, finish within their own bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TERM_GRACE = 3.0  # seconds a helper sent SIGTERM gives what it holds
TERM_BOUND = 4.5  # after SIGTERM it is gone within this, whatever it is doing
ORPHAN_SLACK = 10.0  # beyond the shutdown grace, for a helper whose parent is gone
PARENT_POLL = 0.5  # where the kernel cannot tell: how often the parent is looked for
EXIT_OVERDUE = 70  # exit code of a helper ended by its deadline
_SIGNALS = {signal.SIGTERM, signal.SIGHUP}
_PR_SET_PDEATHSIG = 1


def leftover_wait(grace: float) -> float:
    """How long a new proxy waits for the helpers a killed one left on the same spool: they
    are gone within the grace and ORPHAN_SLACK of their parent's death (with TERM_BOUND to
    spare, for one stopped by SIGTERM meanwhile)."""
    return grace + ORPHAN_SLACK + TERM_BOUND


def orphan_bound(grace: float) -> float:
    """How long a proxy whose starter died may take to drain: in-flight requests and then
    the capture process each get the grace, with ORPHAN_SLACK to spare."""
    return 2 * grace + ORPHAN_SLACK


def watch_pipe(fd: int, on_end: Callable[[], None]) -> None:
    """Call `on_end` (from a thread of its own) once `fd` reads end of file: every holder of
    the pipe's write end has ended, however it ended."""

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:  # not a pipe, or closed: nothing to watch, as good as ended
            pass
        on_end()

    threading.Thread(target=watch, name="lifeline-pipe", daemon=True).start()


def exit_by(seconds: float, name: str, why: str) -> None:
    """End the process `seconds` from now, whatever it is doing then (its helpers are left
    to their own lifelines: they hold what they finish themselves)."""

    def end() -> None:
        time.sleep(seconds)  # a deadline, not a wait for anything
        log.error("the %s did not finish in time (%s): exiting now", name, why)
        logging.shutdown()
        os._exit(EXIT_OVERDUE)

    threading.Thread(target=end, name="deadline", daemon=True).start()


_children: set[int] = set()  # helper processes this one started: they end with it


def adopt(pid: int) -> None:
    """A helper process this one started: killed with it if it must end at its deadline."""
    _children.add(pid)


def disown(pid: int) -> None:
    _children.discard(pid)


class Lifeline:
    """One helper's reasons and deadlines to stop. `watch` first thing, in the main thread
    (the signal mask it sets is inherited by every thread made after it); `attach` from the
    event loop; `holding` once there is work to finish; `ended` says when to stop and how
    many seconds are left for it."""

    def __init__(self, name: str, parent: int, grace: float) -> None:
        self.name = name
        self.parent = parent
        self.grace = grace
        self.reason: str | None = None
        self._drain_deadline = 0.0
        self._hard_deadline: float | None = None
        self._holding = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._noted: int | None = None  # a signal caught by a handler (no sigtimedwait)
        self._woken = threading.Event()

    def watch(self) -> None:
        """Take SIGTERM and SIGHUP in a thread of our own; SIGHUP when the parent dies."""
        if hasattr(signal, "sigtimedwait"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        else:  # pragma: no cover - platforms without sigtimedwait
            for sig in _SIGNALS:
                signal.signal(sig, self._note)
        _parent_death_signal(signal.SIGHUP)
        threading.Thread(target=self._watch, name="lifeline", daemon=True).start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loop = loop
            self._event = asyncio.Event()
            if self.reason is not None:
                self._event.set()

    def holding(self) -> None:
        """From now on there is work to finish: a reason to stop no longer ends it at once."""
        with self._lock:
            self._holding = True
            ended = self.reason is not None
        if ended:
            log.info("the %s stops before it started (%s)", self.name, self.reason)
            _exit(0)

    async def ended(self) -> float:
        """When there is a reason to stop: the seconds left to finish what it holds."""
        assert self._event is not None, "attach() first"
        await self._event.wait()
        return self.remaining()

    def remaining(self) -> float:
        return max(0.0, self._drain_deadline - time.monotonic())

    def parent_gone(self) -> float:
        """The parent's end of the socket closed: the same as its death."""
        self._trigger(f"the process that started it ({self.parent}) is gone", self.grace,
                      self.grace + ORPHAN_SLACK)  # fmt: skip
        return self.remaining()

    # --- the watching thread ---

    def _watch(self) -> None:
        while True:
            if os.getppid() != self.parent:  # also when it died before we could ask the kernel
                self.parent_gone()
            deadline = self._hard_deadline
            wait = PARENT_POLL
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    log.error("the %s did not finish in time (%s): exiting now", self.name,
                              self.reason)  # fmt: skip
                    _exit(EXIT_OVERDUE)
                wait = min(wait, PARENT_POLL)
            if self._next_signal(wait) == signal.SIGTERM:
                self._trigger("SIGTERM", TERM_GRACE, TERM_BOUND)

    def _next_signal(self, timeout: float) -> int | None:
        if hasattr(signal, "sigtimedwait"):
            info = signal.sigtimedwait(_SIGNALS, timeout)
            return None if info is None else info.si_signo
        self._woken.wait(timeout)  # pragma: no cover - platforms without sigtimedwait
        self._woken.clear()  # pragma: no cover
        noted, self._noted = self._noted, None  # pragma: no cover
        return noted  # pragma: no cover

    def _note(self, signum: int, frame: object) -> None:  # pragma: no cover
        self._noted = signum
        self._woken.set()

    def _trigger(self, why: str, drain: float, bound: float) -> None:
        with self._lock:
            now = time.monotonic()
            if self._hard_deadline is not None and now + bound >= self._hard_deadline:
                return  # an earlier reason already asks for less
            self._drain_deadline = now + drain
            self._hard_deadline = now + bound
            first = self.reason is None
            self.reason = why
            holding, loop, event = self._holding, self._loop, self._event
        if not holding:
            _exit(0)  # nothing to finish; what the socket holds is its parent's to count
        if first:
            log.warning("the %s stops (%s): finishing what it holds within %.0f s", self.name,
                        why, drain)  # fmt: skip
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: it is ending anyway
                loop.call_soon_threadsafe(event.set)


def _parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends `sig` when the thread that started us ends (our parents start
    helpers from a thread that lives as long as they do)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _exit(code: int) -> None:
    """End now, and the helpers we started with us (what they hold is on disk: the spool)."""
    for pid in list(_children):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    logging.shutdown()
    os._exit(code)
