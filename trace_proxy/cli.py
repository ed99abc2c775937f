"""`trace-proxy serve | demo | show | recover | ui | replay | export`: the command line, one
table of subcommands. Each has a module of its own that registers its options and runs it,
importing what is heavy only when it runs, so that `--help` and a typo answer at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trace_proxy.commandline import DESCRIPTION, UsageParser
from trace_proxy.config import values_may_start_with_dash
from trace_proxy.dataset.command import add_export_command, run_export_command
from trace_proxy.demo.command import add_demo_command, run_demo_command
from trace_proxy.processes.recover_command import add_recover_command, run_recover_command
from trace_proxy.proxy.command import add_serve_command, run_serve_command
from trace_proxy.replay.command import add_replay_command, run_replay_command
from trace_proxy.show import add_show_command, run_show_command
from trace_proxy.ui.command import add_ui_command, run_ui_command


@dataclass(frozen=True)
class Command:
    """A subcommand: `add` registers its parser, under the name it has in `COMMANDS`, on the
    CLI's subparsers; `run` runs it from the parsed options and returns the exit code."""

    add: Callable[[Any], None]
    run: Callable[[dict[str, Any]], int]


# In the order `trace-proxy --help` lists them.
COMMANDS: dict[str, Command] = {
    "serve": Command(add_serve_command, run_serve_command),
    "demo": Command(add_demo_command, run_demo_command),
    "show": Command(add_show_command, run_show_command),
    "recover": Command(add_recover_command, run_recover_command),
    "ui": Command(add_ui_command, run_ui_command),
    "replay": Command(add_replay_command, run_replay_command),
    "export": Command(add_export_command, run_export_command),
}


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(prog="trace-proxy", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=UsageParser)
    commands.required = True
    for command in COMMANDS.values():
        command.add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = vars(
        parser.parse_args(values_may_start_with_dash(sys.argv[1:] if argv is None else argv))
    )
    return COMMANDS[args.pop("command")].run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
