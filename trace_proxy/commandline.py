"""What the subcommands share: a parser whose error is one line (exit 2), and for those that
run on `Settings` (serve, demo, recover) an error printed the same way and a coroutine run on
uvloop. Nothing heavy: the CLI imports every command's module to list its options."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn

EXIT_USAGE = 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DESCRIPTION = """\
A transparent reverse proxy in front of vLLM / SGLang servers that records every generate call
of every RL rollout as trajectories, without changing a byte of the traffic."""


class UsageParser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the problem, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"trace-proxy: error: {message}\n")


def usage_error(message: str) -> int:
    """`message` as the one line of a usage error; the exit code that goes with it."""
    print(f"trace-proxy: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_coroutine(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(main)
    return uvloop.run(main)
