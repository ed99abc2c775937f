"""Every reason the proxy can count a call or a record as dropped is named in the table of drop
reasons in docs/reliability.md, and the table names no reason the code cannot count: a user reading
`trace_proxy_capture_dropped{reason="capture_process_down"}` on /metrics finds what it means.

The code's reasons are found in its source, the way a reader greps for them: each string given
as the reason label of a dropped counter (`capture_dropped`, `spool_dropped`, `export_dropped`,
`sampler_dropped`, or a local name bound to one), and the reasons the pipeline and the sampling
gate pass to their own counting helpers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import trace_proxy

PACKAGE = Path(trace_proxy.__file__).parent
DROP_REASONS_DOC = PACKAGE.parent / "docs" / "reliability.md"
COUNTERS = {
    "capture_dropped": "trace_proxy_capture_dropped",
    "spool_dropped": "trace_proxy_spool_dropped",
    "export_dropped": "trace_proxy_export_dropped",
    "sampler_dropped": "trace_proxy_sampler_dropped",
}
# Helpers that count a reason they are given: (file, function) -> counter.
HELPERS = {
    ("exporters/pipeline.py", "_dropped"): "trace_proxy_spool_dropped",
    ("trajectories/gate.py", "_drop"): "trace_proxy_sampler_dropped",
}
ROW = re.compile(r"^\| `(trace_proxy_\w+)` \| `(\w+)` \|", re.MULTILINE)


def _counter_of(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The counter a `.labels(...)` call is made on: `x.capture_dropped`, or a local name
    bound to one (`dropped = self._metrics.export_dropped`)."""
    if isinstance(node, ast.Attribute) and node.attr in COUNTERS:
        return COUNTERS[node.attr]
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _strings(call: ast.Call) -> list[str]:
    values = [*call.args, *(k.value for k in call.keywords if k.arg == "reason")]
    return [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def reasons_in_code() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                counter = _counter_of(node.value, {})
                for target in node.targets:
                    if counter is not None and isinstance(target, ast.Name):
                        aliases[target.id] = counter
        helpers = {name: c for (file, name), c in HELPERS.items() if file == relative}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in helpers:
                for default in node.args.defaults + node.args.kw_defaults:
                    if isinstance(default, ast.Constant) and isinstance(default.value, str):
                        found.add((helpers[node.name], default.value))
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr == "labels":
                counter = _counter_of(node.func.value, aliases)
                if counter is not None:
                    found.update((counter, reason) for reason in _strings(node)[-1:])
            elif node.func.attr in helpers:
                found.update((helpers[node.func.attr], r) for r in _strings(node)[:1])
    return found


def documented_reasons() -> set[tuple[str, str]]:
    return set(ROW.findall(DROP_REASONS_DOC.read_text()))


def test_the_code_counts_the_reasons_this_test_looks_for() -> None:
    """The scan finds what it is meant to (else the comparison below proves nothing)."""
    found = reasons_in_code()
    assert ("trace_proxy_capture_dropped", "capture_process_down") in found  # the forwarder
    assert ("trace_proxy_export_dropped", "spool_corrupt") in found  # through a local name
    assert ("trace_proxy_spool_dropped", "spool_full") in found  # through `_dropped`
    assert ("trace_proxy_sampler_dropped", "sampler") in found  # `_drop`'s default
    assert {counter for counter, _ in found} == set(COUNTERS.values())


def test_the_docs_name_every_drop_reason_the_code_counts_and_no_other() -> None:
    code, documented = reasons_in_code(), documented_reasons()
    assert code - documented == set(), "counted but not documented"
    assert documented - code == set(), "documented but never counted"
