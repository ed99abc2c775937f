"""`trace-proxy serve`: its options (all from the option table), the settings checked, and a
running proxy's life on the command line: the line it starts with, SIGTERM/SIGINT and
`--lifeline-fd` to stop, the line it ends with. The proxy itself is imported only to run."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from trace_proxy.commandline import (
    DESCRIPTION,
    EXIT_USAGE,
    LOG_FORMAT,
    run_coroutine,
    usage_error,
)
from trace_proxy.config import ConfigError, Settings, add_options, resolve
from trace_proxy.logtext import configure_logging

log = logging.getLogger(__name__)


def add_serve_command(commands: Any) -> None:
    """Register `trace-proxy serve --upstream URL ...` on the CLI's subparsers."""
    serve = commands.add_parser(
        "serve", help="run the proxy in front of one or more upstreams", description=DESCRIPTION
    )
    add_options(serve, "serve")


def run_serve_command(args: dict[str, Any]) -> int:
    try:
        settings = resolve("serve", args)
        if not settings.upstream and not settings.register_upstreams:
            raise ConfigError(
                "--upstream is required (or TRACE_PROXY_UPSTREAM, or a config file), "
                "unless --register-upstreams"
            )
    except ConfigError as exc:
        return usage_error(str(exc))
    # Our own messages at the chosen level; libraries' chatter only when it is a warning.
    configure_logging(LOG_FORMAT, settings.log_level)
    from trace_proxy.processes.helper import tune_malloc

    tune_malloc()  # the forwarder copies long bodies too, as its helpers do
    return run_coroutine(_serve(settings))


async def _serve(settings: Settings) -> int:
    from trace_proxy.proxy.service import ProxyService
    from trace_proxy.text.token2text import TokenizerError

    try:
        service = ProxyService(settings)
    except ConfigError as exc:
        return usage_error(str(exc))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    if settings.lifeline_fd is not None:
        _end_with_starter(settings, loop, stopping)
    try:
        addresses = await service.start()
    except (TokenizerError, ConfigError) as exc:
        print(f"trace-proxy: error: {_start_error(exc)}", file=sys.stderr)
        await service.stop()
        return EXIT_USAGE
    except OSError as exc:
        ports = f"{settings.port}" + (
            f" (admin {settings.admin_port})" if settings.admin_port is not None else ""
        )
        print(f"trace-proxy: error: cannot listen on {settings.host}:{ports}: "
              f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
        await service.stop()
        return 1
    _say(
        f"trace-proxy: forwarding {addresses.proxy} -> {_targets(settings)}; "
        f"records -> {', '.join(settings.backend)} ({settings.output}); "
        f"metrics at {addresses.admin}/metrics, readiness at {addresses.admin}/ready"
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    failure = service.failure
    assert failure is not None
    signalled = asyncio.ensure_future(stopping.wait())
    waits: list[asyncio.Future[Any]] = [signalled, failure]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    code = 0
    if failure.done():  # found while starting in the background: the same one clear error
        print(f"trace-proxy: error: {_start_error(failure.result())}", file=sys.stderr,
              flush=True)  # fmt: skip
        code = EXIT_USAGE
    _say("trace-proxy: stopping: draining in-flight requests, then flushing records")
    await service.stop()
    left = service.backlog
    spooled = f"; left in the spool: {_counts(left)}" if left is not None else ""
    _say(f"trace-proxy: stopped{spooled}")
    return code


def _say(line: str) -> None:
    """A line on stdout; when no one reads it any more (the process that started the proxy
    has died with the pipe's other end), this and every later line go nowhere instead."""
    try:
        print(line, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _end_with_starter(
    settings: Settings, loop: asyncio.AbstractEventLoop, stopping: asyncio.Event
) -> None:
    """--lifeline-fd: when the process that started the proxy ends, stop as on SIGTERM, all
    of it within `orphan_bound` (processes/lifeline.py)."""
    from trace_proxy.processes.lifeline import exit_by, orphan_bound, watch_pipe

    assert settings.lifeline_fd is not None
    bound = orphan_bound(settings.shutdown_grace)

    def ended() -> None:
        log.warning("trace-proxy: the process that started it has ended: draining what it "
                    "holds, within %.0f s", bound)  # fmt: skip
        exit_by(bound, "proxy", "the process that started it has ended")
        stopping.set()

    def from_the_watcher() -> None:
        loop.call_soon_threadsafe(ended)

    watch_pipe(settings.lifeline_fd, from_the_watcher)


def _targets(settings: Settings) -> str:
    targets = list(settings.upstream)
    if settings.register_upstreams:
        targets.append("registered upstreams")
    return ", ".join(targets)


def _start_error(error: BaseException) -> str:
    from trace_proxy.text.token2text import TokenizerError

    if isinstance(error, TokenizerError):
        return f"invalid value for --tokenizer: {error}"
    return str(error)


def _counts(backlog: dict[str, int]) -> str:
    """Records per backend, as `jsonl 0, mlflow 12`."""
    return ", ".join(f"{name} {count}" for name, count in backlog.items())
