"""The core packages import only what lies below them (docs/ARCHITECTURE.md): the trajectories
know nothing of the text read from them or of the store they are written to, so either can
change, or be left out, without touching how calls become trajectories."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trace_proxy

PACKAGE = Path(trace_proxy.__file__).parent

# What each package may import from trace_proxy besides itself.
BELOW = {
    "trajectories": {"safejson"},
    "text": {"trajectories", "safejson"},
    "store": {"trajectories", "safejson"},
}


def imported(source: Path) -> set[str]:
    """The trace_proxy packages or modules `source` imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "trace_proxy":
                names = [f"trace_proxy.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name.split(".")[1] for name in names if name.startswith("trace_proxy.")}
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_core_package_imports_only_what_lies_below_it(package: str) -> None:
    sources = sorted((PACKAGE / package).rglob("*.py"))
    assert sources, package
    upward = {
        str(source.relative_to(PACKAGE)): sorted(imported(source) - BELOW[package] - {package})
        for source in sources
    }
    assert {path: names for path, names in upward.items() if names} == {}
