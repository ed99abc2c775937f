"""`trace-proxy serve | demo | show | ui | replay | export | recover`: the command line, from
the declared options."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from trace_proxy.config import (
    ConfigError,
    Settings,
    add_options,
    resolve,
    values_may_start_with_dash,
)
from trace_proxy.logtext import configure_logging

EXIT_USAGE = 2
log = logging.getLogger(__name__)

DESCRIPTION = """\
A transparent reverse proxy in front of vLLM / SGLang servers that records every generate call
of every RL rollout as trajectories, without changing a byte of the traffic."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the problem, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"trace-proxy: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trace-proxy", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    serve = commands.add_parser(
        "serve", help="run the proxy in front of one or more upstreams", description=DESCRIPTION
    )
    add_options(serve, "serve")

    demo = commands.add_parser(
        "demo",
        help="run a simulated vLLM server and a tool-calling agent through the proxy",
        description="Start a simulated vLLM server (real Qwen tokenizer, built offline), run a "
        "small multi-turn tool-calling RL rollout through the proxy, and write the store.",
    )
    add_options(demo, "demo")
    demo.add_argument("--samples", type=int, default=4, help="samples per step [default: 4]")
    demo.add_argument("--rollouts", type=int, default=2, help="rollouts per sample [default: 2]")
    demo.add_argument("--steps", type=int, default=2, help="training steps [default: 2]")

    show = commands.add_parser("show", help="print stored trajectories readably")
    show.add_argument(
        "directory",
        nargs="+",
        help="the --output directory of serve or demo; "
        "several (one per replica) are read as one store",
    )
    show.add_argument("--step", type=int, help="only this step")
    show.add_argument("--experiment", help="only this experiment")
    show.add_argument("--limit", type=int, default=None, help="at most this many trajectories")
    show.add_argument("--width", type=int, default=100, help="characters of text per call line")

    recover = commands.add_parser(
        "recover",
        help="write to the store what a killed proxy left in its spool",
        description="Write to each store under DIRECTORY (replicas included) the records "
        "its proxy spooled but could not write before it was killed with all its processes; "
        "from where that proxy's jsonl backend stopped, so nothing is written twice. A spool "
        "a running proxy holds is left alone.",
    )
    recover.add_argument("directory", nargs="+", help="the --output directory of serve")
    add_options(recover, "recover")

    from trace_proxy.dataset.command import add_export_command
    from trace_proxy.replay.command import add_replay_command
    from trace_proxy.ui.command import add_ui_command

    add_ui_command(commands)
    add_replay_command(commands)
    add_export_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = vars(
        parser.parse_args(values_may_start_with_dash(sys.argv[1:] if argv is None else argv))
    )
    command = args.pop("command")
    if command == "ui":
        from trace_proxy.ui.command import run_ui_command

        configure_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_ui_command(args)
    if command == "replay":
        from trace_proxy.replay.command import run_replay_command

        configure_logging("%(asctime)s %(levelname)s %(name)s: %(message)s", "WARNING")
        return run_replay_command(args)
    if command == "export":
        from trace_proxy.dataset.command import run_export_command

        return run_export_command(args)
    if command == "show":
        from trace_proxy.show import show

        try:
            return show(
                args["directory"],
                step=args["step"],
                experiment=args["experiment"],
                limit=args["limit"],
                width=args["width"],
            )
        except BrokenPipeError:  # `trace-proxy show DIR | head` is fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    extra = {k: args.pop(k) for k in ("samples", "rollouts", "steps") if k in args}
    directories = [Path(d) for d in args.pop("directory", [])]
    try:
        settings = resolve(command, args)
        if command == "serve" and not settings.upstream and not settings.register_upstreams:
            raise ConfigError(
                "--upstream is required (or TRACE_PROXY_UPSTREAM, or a config file), "
                "unless --register-upstreams"
            )
    except ConfigError as exc:
        print(f"trace-proxy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Our own messages at the chosen level; libraries' chatter only when it is a warning.
    configure_logging("%(asctime)s %(levelname)s %(name)s: %(message)s", settings.log_level)
    if command == "recover":
        from trace_proxy.processes.recover import recover

        missing = [str(d) for d in directories if not d.is_dir()]
        if missing:
            print(f"trace-proxy: error: not a directory: {', '.join(missing)}", file=sys.stderr)
            return EXIT_USAGE
        return _run(recover(directories, settings, sys.stdout))
    if command == "serve":
        from trace_proxy.processes.helper import tune_malloc

        tune_malloc()  # the forwarder copies long bodies too, as its helpers do
        return _run(_serve(settings))
    from trace_proxy.demo.run import run_demo

    try:
        return _run(run_demo(settings, **extra))
    except ConfigError as exc:
        print(f"trace-proxy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(settings: Settings) -> int:
    from trace_proxy.proxy.service import ProxyService
    from trace_proxy.text.token2text import TokenizerError

    try:
        service = ProxyService(settings)
    except ConfigError as exc:
        print(f"trace-proxy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
