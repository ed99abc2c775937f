"""The `ui` subcommand's options, apart from the server so that the CLI imports nothing heavy."""

from __future__ import annotations

from typing import Any

from trace_proxy.commandline import LOG_FORMAT
from trace_proxy.logtext import configure_logging

DEFAULT_PORT = 8300


def add_ui_command(commands: Any) -> None:
    """Register `trace-proxy ui [STORE ...] [--host] [--port]` on the CLI's subparsers."""
    ui = commands.add_parser(
        "ui",
        help="browse stored rollouts in a web browser (steps, GRPO groups, trajectories)",
        description="Serve a local web viewer of jsonl stores: runs, steps, a step's GRPO groups "
        "side by side, a trajectory turn by turn, sibling rollouts compared, a run searched "
        "across its steps. It follows stores "
        "a running proxy is still writing.",
    )
    ui.add_argument(
        "stores", nargs="*", default=["traces"], metavar="STORE",
        help="--output directories of serve or demo [default: traces]",
    )  # fmt: skip
    ui.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on [default: 127.0.0.1, this machine only]",
    )  # fmt: skip
    ui.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"port to listen on, 0 for any free one [default: {DEFAULT_PORT}]",
    )  # fmt: skip
    ui.add_argument(
        "--tokenizer", metavar="PATH",
        help="a local tokenizer directory: token texts beside their logprobs "
        "(needs trace-proxy[text]); without it, token ids",
    )  # fmt: skip
    ui.add_argument(
        "--index-dir", metavar="DIR",
        help="where the search's full-text index is built (a temporary directory in it, "
        "removed on exit; never inside a store) [default: the system's temporary directory]",
    )  # fmt: skip


def run_ui_command(args: dict[str, Any]) -> int:
    configure_logging(LOG_FORMAT)
    from trace_proxy.ui.server import run_ui

    stores: list[str] = args["stores"]
    return run_ui(stores, args["host"], args["port"], args["tokenizer"], args.get("index_dir"))
