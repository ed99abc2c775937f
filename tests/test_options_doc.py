"""docs/options.md is the option table as the code declares it: a user reading a default or a
flag there reads what `trace-proxy serve` takes, and a changed option cannot leave it behind.

It is written by scripts/options_doc.py; these tests fail when the committed page is not what
the script writes now, or when what it writes could not be typed back.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import trace_proxy
from trace_proxy.config import OPTIONS, resolve

ROOT = Path(trace_proxy.__file__).resolve().parent.parent  # the checkout the tests run against
SCRIPT = ROOT / "scripts" / "options_doc.py"
DOC = ROOT / "docs" / "options.md"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)[^|]*\| `(TRACE_PROXY_\w+)`<br>`(\w+)` \| ([^|]+) \|", re.M)


def options_doc() -> SimpleNamespace:
    """The script's functions, as `python scripts/options_doc.py` would run them."""
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="options_doc"))


def test_the_committed_options_page_is_what_the_script_writes() -> None:
    assert DOC.read_text(encoding="utf-8") == options_doc().render(), (
        "docs/options.md is not current: run python scripts/options_doc.py"
    )


def test_the_page_has_a_row_for_every_option_in_the_table_order() -> None:
    rows = ROW.findall(options_doc().render())
    assert [(flag, env, key) for flag, env, key, _ in rows] == [
        (opt.flag, opt.env, opt.name) for opt in OPTIONS
    ]


def test_every_default_shown_is_a_value_the_option_takes_back() -> None:
    """A default written as `128MiB` or `10` resolves, from the variable it names, to the
    declared default: the page never shows a value the proxy would read differently."""
    for flag, env, name, default in ROW.findall(options_doc().render()):
        opt = next(o for o in OPTIONS if o.name == name)
        shown = default.strip()
        if not shown.startswith("`"):
            assert shown in ("none", "off"), (flag, shown)
            assert opt.default in (None, [], False), (flag, opt.default)
            continue
        environ = {env: shown.strip("`"), "TRACE_PROXY_UPSTREAM": "http://127.0.0.1:1"}
        assert getattr(resolve("serve", {}, environ), name) == opt.default, flag


def test_check_mode_tells_a_stale_page_from_a_current_one(tmp_path: Path) -> None:
    script, page = options_doc(), tmp_path / "options.md"
    page.write_text(script.render().replace("`8100`", "`8000`"), encoding="utf-8")
    assert script.main(["--check"], doc=page) == 1
    assert script.main([], doc=page) == 0
    assert script.main(["--check"], doc=page) == 0


def test_the_script_runs_as_documented() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
