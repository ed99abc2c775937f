"""`trace-proxy export`'s options, apart from the writing, so that the CLI imports nothing heavy.

pyarrow and tqdm come with the `dataset` extra; without them the command says which extra to
install and exits 2, as for any other bad input.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
NEEDED = ("pyarrow", "tqdm")


def add_export_command(commands: Any) -> None:
    """Register `trace-proxy export STORE --form sft|rl --out DIR [filters]`."""
    export = commands.add_parser(
        "export",
        help="write stored trajectories as Parquet for training tools (SFT or RL form)",
        description="Write a store's trajectories as a directory of Parquet files that "
        "datasets.load_dataset('parquet', data_files='DIR/*.parquet') reads. sft: one row per "
        "trajectory, its conversation as OpenAI chat messages (tool calls and results "
        "included). rl: one row per turn, prompt_ids, response_ids, loss_mask and logprobs, "
        "to replay a batch. Late rewards are merged; replicas are read as one store.",
    )
    export.add_argument("store", metavar="STORE", help="the --output directory of serve or demo")
    export.add_argument("--form", choices=("sft", "rl"), required=True, help="the rows' form")
    export.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="directory for the Parquet files (created; must be empty)",
    )
    export.add_argument(
        "--force", action="store_true", help="replace the Parquet files already in --out"
    )
    export.add_argument(
        "--run",
        metavar="PROJECT/EXPERIMENT",
        help="only this run (or experiment) [default: every run]",
    )
    export.add_argument(
        "--step",
        metavar="N|A:B",
        help="only step N, or steps A to B (both included; A: and :B open)",
    )
    export.add_argument(
        "--validation",
        choices=("exclude", "include", "only"),
        default="exclude",
        help="validation rollouts: left out, taken too, or taken alone [default: exclude]",
    )
    export.add_argument(
        "--status",
        choices=("ok", "error", "any"),
        default="ok",
        help="trajectories whose calls all succeeded (ok), those with a failed call (error), "
        "or both [default: ok]",
    )
    export.add_argument(
        "--min-reward",
        type=float,
        metavar="R",
        help="only trajectories with a reward of at least R (late ones count)",
    )
    export.add_argument(
        "--max-reward", type=float, metavar="R", help="only trajectories with a reward of at most R"
    )
    export.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local tokenizer directory: rl, to fill token ids a call was recorded without "
        "(chat without return_token_ids); sft, to decode token-in trajectories recorded "
        "without token2text; needs trace-proxy[text]",
    )
    export.add_argument(
        "--tool-parser",
        default="hermes",
        metavar="NAME",
        help="sft: how token-in answers write tool calls [default: hermes]",
    )
    export.add_argument(
        "--rows-per-file",
        type=int,
        default=100_000,
        metavar="N",
        help="rows per Parquet file [default: 100000]",
    )


def run_export_command(args: dict[str, Any]) -> int:
    missing = [name for name in NEEDED if not _importable(name)]
    if missing:
        return _error(f"export needs {' and '.join(missing)}: pip install 'trace-proxy[dataset]'")
    from trace_proxy.dataset.build import write_dataset
    from trace_proxy.dataset.reading import Selection, SelectionError, StepRange
    from trace_proxy.exporters.leftovers import leftovers, notice
    from trace_proxy.logtext import printable
    from trace_proxy.text.token2text import TokenizerError, load_tokenizer
    from trace_proxy.text.toolparsers import get_parser

    if args["rows_per_file"] < 1:
        return _error("--rows-per-file must be at least 1")
    try:
        parser = get_parser(args["tool_parser"])
    except ValueError as exc:
        return _error(f"--tool-parser: {exc}")
    try:
        selection = Selection(
            steps=None if args["step"] is None else StepRange.parse(args["step"]),
            validation=args["validation"],
            min_reward=args["min_reward"],
            max_reward=args["max_reward"],
            status=args["status"],
            run=args["run"],
        )
        tokenizer = load_tokenizer(args["tokenizer"]) if args["tokenizer"] else None
        left = leftovers([Path(args["store"])])
        if left:
            print(printable(notice(left)), file=sys.stderr, flush=True)
        written = write_dataset(
            Path(args["store"]),
            Path(args["out"]),
            args["form"],
            selection,
            force=args["force"],
            tokenizer=tokenizer,
            tool_parser=parser,
            rows_per_file=args["rows_per_file"],
        )
    except TokenizerError as exc:
        return _error(f"invalid value for --tokenizer: {printable(str(exc))}")
    except SelectionError as exc:
        return _error(printable(str(exc)))
    except KeyboardInterrupt:
        print(
            "trace-proxy: export interrupted; the files written so far are complete",
            file=sys.stderr,
        )
        return 130
    print(
        printable(
            f"wrote {written.rows} {args['form']} rows in {len(written.files)} Parquet "
            f"file(s) to {args['out']}"
        )
    )
    for line in written.tally.describe().splitlines():
        print(printable(line))
    return 0


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _error(message: str) -> int:
    print(f"trace-proxy: error: {message}", file=sys.stderr)
    return EXIT_USAGE
