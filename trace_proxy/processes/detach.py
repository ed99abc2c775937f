"""Starting a process that outlives the one that starts it just long enough to finish its work.

A proxy started by a job scheduler's worker (a Ray actor) must not die with that worker: what
it holds (open trajectories, records not exported yet) would die with it. Ray kills a
worker's direct children when the worker exits and signals its whole process group, both
with SIGKILL in the end. So `start` runs the command through this module (`python -m
trace_proxy.processes.detach FD -- COMMAND...`), a short-lived intermediate that puts itself
in a new session (a process group of its own), starts the command there and exits: the
command is then nobody's child in the worker's tree, and in no group of it. The starter
holds it by a pidfd (so a signal can never reach another process that reused its pid), and
holds alone the write end of a pipe whose read end the command gets (`--lifeline-fd`): the
pipe reads end of file when the starter dies, however it dies, and the command then finishes
what it holds within a bound and exits.

Where the kernel has no pidfd (not Linux, or before 5.3) the command is the starter's child
in a new session: out of reach of a process-group kill, not of a kill of the worker's children.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from typing import IO

_PID_LINE = "trace-proxy-detached-pid "


class DetachedProcess:
    """A started command: its pid, its output (the pipe its lines come through), whether it
    still runs, signals to it; `release` closes the lifeline (the command then ends)."""

    def __init__(
        self, pid: int, stdout: IO[str], lifeline: int, pidfd: int | None,
        child: subprocess.Popen[str] | None = None,
    ) -> None:  # fmt: skip
        self.pid = pid
        self.stdout = stdout
        self._lifeline = lifeline
        self._pidfd = pidfd
        self._child = child  # where there is no pidfd: our own child
        self._ended = False

    def running(self) -> bool:
        return not self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the command has exited (within `timeout` seconds; None: however long)."""
        if self._ended:
            return True
        if self._child is not None:
            try:
                self._child.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
        else:
            assert self._pidfd is not None
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            if not poller.poll(None if timeout is None else int(timeout * 1000)):
                return False
        self._ended = True
        return True

    def send_signal(self, sig: int) -> None:
        if self._ended:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._child is not None:
                self._child.send_signal(sig)
            else:
                assert self._pidfd is not None
                signal.pidfd_send_signal(self._pidfd, sig)

    def release(self) -> None:
        """Close our end of the lifeline: the command stops as when we die."""
        if self._lifeline >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = -1


def lifeline_pipe() -> tuple[int, int]:
    """A pipe for `start`: the read end for the command (its number goes on its command
    line), the write end held by the caller alone (neither inherited by anything else)."""
    return os.pipe()


def start(command: list[str], lifeline: tuple[int, int], env: dict[str, str]) -> DetachedProcess:
    """Start `command` detached (see the module's docstring), its output and errors on one
    pipe (`stdout` of the result), its stdin empty, the read end of `lifeline` passed on."""
    read_end, write_end = lifeline
    try:
        if not _has_pidfd():
            return _start_child(command, read_end, write_end, env)
        starter = subprocess.Popen(
            [sys.executable, "-m", "trace_proxy.processes.detach", str(read_end), "--", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            pass_fds=[read_end],
        )
    finally:
        os.close(read_end)
    assert starter.stdin is not None and starter.stdout is not None
    line = starter.stdout.readline()  # the first line: nothing else writes before it
    if not line.startswith(_PID_LINE):
        starter.wait()
        os.close(write_end)
        raise OSError(f"could not start {command[0]}: {line.strip() or 'no output'}")
    pid = int(line[len(_PID_LINE) :])
    pidfd = os.pidfd_open(pid)  # still the starter's child: the pid cannot be reused yet
    starter.stdin.close()  # the starter exits now, leaving the command to init
    starter.wait()
    return DetachedProcess(pid, starter.stdout, write_end, pidfd)


def _has_pidfd() -> bool:
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel before 5.3
        return False
    return True


def _start_child(
    command: list[str], read_end: int, write_end: int, env: dict[str, str]
) -> DetachedProcess:
    child = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, pass_fds=[read_end], start_new_session=True,
    )  # fmt: skip
    assert child.stdout is not None
    return DetachedProcess(child.pid, child.stdout, write_end, None, child)


def _main(argv: list[str]) -> int:
    """The intermediate: a new session, the command started in it, its pid told, and gone as
    soon as the starter has a handle on it (our stdin closes)."""
    fd, command = int(argv[0]), argv[2:]
    os.setsid()
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=[fd])
    sys.stdout.write(f"{_PID_LINE}{child.pid}\n")
    sys.stdout.flush()
    sys.stdin.read()
    os._exit(0)  # never waits for the child: it is init's from now on


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
