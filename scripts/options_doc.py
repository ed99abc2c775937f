"""Write docs/options.md from the option table, so the options reference says what the code
declares: each row is one `trace_proxy.config.OPTIONS` entry (flag, variable, default, the
commands that take it, its help text), never restated by hand.

    python scripts/options_doc.py           # write docs/options.md
    python scripts/options_doc.py --check   # exit 1 when docs/options.md is not current

tests/test_options_doc.py fails when the committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trace_proxy.config import OPTIONS, Option, parse_size

DOC = Path(__file__).resolve().parent.parent / "docs" / "options.md"

PREAMBLE = """\
# Options

<!-- Written by scripts/options_doc.py from trace_proxy/config.py's option table: change an
option's help there (or this page's text in the script), then run
`python scripts/options_doc.py`. tests/test_options_doc.py fails when this page is not current. -->

Every option of `trace-proxy serve` is a flag, an environment variable `TRACE_PROXY_<OPTION>`, or
a key of a YAML or TOML file given with `--config FILE` (or `TRACE_PROXY_CONFIG`), in that
order of precedence, then the default. A file's keys are the options' names (`max_samples_per_step`,
or `max-samples-per-step`); a config file may also use verl's names (`project_name`,
`experiment_name`, `max_samples_per_step_per_worker`, or a `trace:` block). An option that takes
several values is repeated on the command line, or comma-separated in a variable or a file
(`TRACE_PROXY_BACKEND=jsonl,mlflow`), except `--map`, `--tokenizer` and `--otlp-header`, whose
values may hold commas: a variable gives one of those, a file a list. A switch
(`--token2text`) is `true` or `false` in a variable or a file.

`trace-proxy serve --help` lists the same options; `trace-proxy demo` and
`trace-proxy recover` take the ones marked with their name. `serve` needs at least one
`--upstream`, unless `--register-upstreams`. An invalid option or value (an unknown key in a
config file too) ends with a one-line error naming it, and exit code 2. The other commands
(`show`, `ui`, `replay`, `export`) have flags of their own: `trace-proxy COMMAND --help`.

Where each option's subject is explained: [which rollout a call belongs to](keys.md),
[text and tools](text-and-tools.md), [sampling and rewards](sampling-and-rewards.md),
[backends](backends.md), [recording under load and failure](reliability.md) (the capture and
export processes, the spool), [running a proxy](running.md) (start, readiness, stop, errors,
limits), [security](security.md).

| option | variable / file key | default | commands | meaning |
|---|---|---|---|---|
"""


def shown_default(opt: Option) -> str:
    """The default as a user would type it: sizes in binary units, lists comma-joined."""
    value: Any = opt.default
    if value is None or value == []:
        return "none"
    if opt.switch and value is False:
        return "off"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`" + ",".join(map(str, value)) + "`"
    if opt.parse is parse_size:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"`{value >> shift}{unit}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def flag_cell(opt: Option) -> str:
    if opt.switch:
        return f"`{opt.flag}`"
    metavar = opt.metavar or opt.name.upper()
    repeat = " (repeatable)" if opt.multiple else ""
    return f"`{opt.flag} {metavar}`{repeat}"


def text_cell(text: str) -> str:
    """Help text as one table cell: nothing in it read as markup or a column break."""
    for raw, escaped in (("\\", "\\\\"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def render() -> str:
    rows = [
        "| "
        + " | ".join(
            (
                flag_cell(opt),
                f"`{opt.env}`<br>`{opt.name}`",
                shown_default(opt),
                ", ".join(opt.commands),
                text_cell(opt.help),
            )
        )
        + " |"
        for opt in OPTIONS
    ]
    return PREAMBLE + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None, doc: Path = DOC) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = doc.is_file() and doc.read_text(encoding="utf-8") == text
        if not current:
            print(f"{doc.name} is not current: run python scripts/options_doc.py", file=sys.stderr)
        return 0 if current else 1
    doc.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
