"""The `verl.plugins` entry point verl imports on every `import verl`: declared, and light.

verl loads every entry point of that group in every process that imports verl (its trainer,
every Ray worker), and logs a failure at debug level only; so loading trace-proxy's must cost
nothing and import nothing that could fail: the standard library, and no verl.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[3]
ENTRY_POINT = "trace_proxy.integrations.verl.fully_async"


def test_pyproject_declares_the_verl_plugin_entry_point() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"] == {"trace_proxy": ENTRY_POINT}


def test_loading_the_entry_point_imports_neither_verl_nor_the_plugin() -> None:
    """Loaded as verl loads it (`EntryPoint.load`): only the hook module, its packages and the
    standard-library module it shares with the manager (`standin.py`)."""
    code = (
        "import json, sys\n"
        "from importlib.metadata import EntryPoint\n"
        f"EntryPoint('trace_proxy', {ENTRY_POINT!r}, 'verl.plugins').load()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('verl', 'trace_proxy', 'ray', 'aiohttp', 'omegaconf'))))\n"
        "print(json.dumps([type(f).__name__ for f in sys.meta_path]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=REPO)  # fmt: skip
    modules, finders = (json.loads(line) for line in result.stdout.splitlines())
    assert modules == [
        "trace_proxy",
        "trace_proxy.integrations",
        "trace_proxy.integrations.verl",
        ENTRY_POINT,
        "trace_proxy.integrations.verl.standin",
    ]
    assert finders[0] == "_RollouterFinder"  # the hook, first, for verl's rollouter only
    assert result.stderr == ""
