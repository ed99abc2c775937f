"""A store written out as a dataset: the chosen form's rows, step by step, into Parquet files.

The progress bar (tqdm, on stderr, only when it is a terminal) counts the bytes of the step
files read; the summary says what was written, what was left out and what rows lack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from trace_proxy.dataset.columns import RL_SCHEMA, SFT_SCHEMA
from trace_proxy.dataset.reading import Selection, Tally, step_files, step_trajectories
from trace_proxy.dataset.rl import IdsFromTokenizer, rl_rows
from trace_proxy.dataset.sft import decode_missing, sft_row
from trace_proxy.dataset.writer import ParquetParts, prepare_directory
from trace_proxy.text.token2text import decoder_for
from trace_proxy.text.toolparsers import DEFAULT_PARSER, ToolCallParser, get_parser

NO_MESSAGES = (
    "trajectories without text for messages (null; recorded without a tokenizer: --tokenizer "
    "decodes them)"
)
UNPARSED = (
    "trajectories with prompt text in no chat template the tool parser knows (kept as user "
    "messages marked unparsed)"
)


@dataclass
class Written:
    files: list[Path]
    rows: int
    tally: Tally


def write_dataset(
    store: Path,
    out: Path,
    form: str,
    selection: Selection,
    *,
    force: bool = False,
    tokenizer: Any = None,
    tool_parser: ToolCallParser | None = None,
    rows_per_file: int = 100_000,
    progress: TextIO | None = None,
) -> Written:
    """Export `store` to Parquet files in `out`. SelectionError: bad input, nothing written."""
    tally = Tally()
    files = step_files(store, selection, tally)  # the store and filters checked before `out`
    sizes = [f.size for f in files]
    prepare_directory(out, force)
    parser = tool_parser or get_parser(DEFAULT_PARSER)
    fill = IdsFromTokenizer(tokenizer) if tokenizer is not None else None
    decode = decoder_for(tokenizer, skip_special_tokens=False) if tokenizer is not None else None
    rows_of: Callable[[dict[str, Any]], list[dict[str, Any]]]
    if form == "sft":

        def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
            if decode is not None:
                decode_missing(record, decode)
            row = sft_row(record, parser)
            if row["messages"] is None:
                tally.notes[NO_MESSAGES] += 1
            elif any(m["unparsed"] for m in row["messages"]):
                tally.notes[UNPARSED] += 1
            return [row]

    else:

        def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
            return rl_rows(record, fill, tally.notes)

    parts = ParquetParts(out, SFT_SCHEMA if form == "sft" else RL_SCHEMA,
                         rows_per_file=rows_per_file)  # fmt: skip
    stream = sys.stderr if progress is None else progress
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, file=stream,
               desc=f"export {form}", disable=None, leave=False)  # fmt: skip
    try:
        for step, size in zip(files, sizes, strict=True):
            for record in step_trajectories(step, selection, tally):
                for row in rows_of(record):
                    parts.add(row)
            bar.update(size)
        written = parts.close()
    except BaseException:
        parts.abandon()
        raise
    finally:
        bar.close()
    return Written(written, parts.rows, tally)
