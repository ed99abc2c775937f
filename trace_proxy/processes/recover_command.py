"""`trace-proxy recover`'s options and checks, apart from the writing (recover.py), so that
the CLI imports nothing heavy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from trace_proxy.commandline import LOG_FORMAT, run_coroutine, usage_error
from trace_proxy.config import ConfigError, add_options, resolve
from trace_proxy.logtext import configure_logging


def add_recover_command(commands: Any) -> None:
    """Register `trace-proxy recover DIRECTORY ... [--token2text ...]`."""
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


def run_recover_command(args: dict[str, Any]) -> int:
    directories = [Path(d) for d in args.pop("directory")]
    try:
        settings = resolve("recover", args)
    except ConfigError as exc:
        return usage_error(str(exc))
    configure_logging(LOG_FORMAT, settings.log_level)
    from trace_proxy.processes.recover import recover

    missing = [str(d) for d in directories if not d.is_dir()]
    if missing:
        return usage_error(f"not a directory: {', '.join(missing)}")
    return run_coroutine(recover(directories, settings, sys.stdout))
