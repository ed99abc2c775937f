"""The golden test: a fixed workload through the proxy, its records and each backend's
rendering of them compared field by field with a copy committed before the house was
rearranged (tests/golden/*.json). Ids and times are normalised: ids to the order in which
they first appear, times to their order within the record; what the machine or its installed
packages put in (a kernel release, a host name, a library's version) to `machine`, so the copies
hold on any machine (`test_another_machine_renders_them_the_same` runs this module on a
different one).

`TRACE_PROXY_GOLDEN=write pytest tests/test_golden.py` writes the copies anew; a change to
them is a change of behaviour, reviewed as one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from golden.render import backend_renderings
from golden.workload import run

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.show import iter_records

GOLDEN = Path(__file__).parent / "golden"
# record, trace and span ids; UUIDs
HEX_ID = re.compile(
    r"\b[0-9a-f]{32}\b|\b[0-9a-f]{16}\b|\b[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\b"
)
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?$")
LOOPBACK = re.compile(r"127\.0\.0\.1:\d+")
# Values the machine or its installed packages give, by key: what Weave's client adds to every
# call (weave.utils.capture_info), the OpenTelemetry SDK's resource (its version; host.*, os.*,
# process.* when resource detectors are on), and the test client's User-Agent header.
MACHINE_KEYS = frozenset({
    "client_version", "sys_version", "os_name", "os_version", "os_release",
    "telemetry.sdk.version", "telemetry.auto.version", "service.version", "user-agent",
})  # fmt: skip
MACHINE_PREFIXES = ("host.", "os.", "process.")


def stored(output: Path) -> list[dict[str, Any]]:
    """Every record of the store, by proxy, in the order the store holds them."""
    records = []
    for proxy in ("vllm", "sglang"):
        for path, record in iter_records(output / proxy):
            records.append({"proxy": proxy, "file": str(path.relative_to(output / proxy)),
                            **record})  # fmt: skip
    return records


def is_time(value: Any) -> bool:
    """A wall-clock time in seconds since the epoch (after 2001), as the records hold it."""
    return isinstance(value, float) and 1e9 < value < 1e11


def is_derived_time(value: Any) -> bool:
    """A time a backend derived from the records' (nanoseconds, ISO 8601): two roundings of
    one instant may differ by a unit, so only their presence is compared."""
    if isinstance(value, int) and not isinstance(value, bool):
        return 1e18 < value < 1e20
    return isinstance(value, str) and ISO_TIME.match(value) is not None


def is_from_the_machine(name: str) -> bool:
    return name.lower() in MACHINE_KEYS or name.startswith(MACHINE_PREFIXES)


class Normaliser:
    """Random ids become `id-N` by first appearance (so references between records are still
    compared), test servers' addresses `server-N`, the records' wall-clock times `t-N` by
    rank within their record (so their order is still compared), times derived from them `t`,
    durations `d`, and what the machine gives `machine`."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def record(self, record: Any) -> Any:
        times: set[Any] = set()
        self._times(record, times)
        ranks = {t: f"t-{n}" for n, t in enumerate(sorted(times))}
        return self._value(record, ranks, None)

    def _times(self, value: Any, found: set[Any]) -> None:
        if isinstance(value, dict):
            for item in value.values():
                self._times(item, found)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._times(item, found)
        elif is_time(value):
            found.add(value)

    def _value(self, value: Any, ranks: dict[Any, str], name: str | None) -> Any:
        if name is not None and is_from_the_machine(name):
            return "machine"
        if isinstance(value, dict):
            return {k: self._value(v, ranks, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._value(v, ranks, name) for v in value]
        if is_time(value):
            return ranks[value]
        if is_derived_time(value):
            return "t"
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and name
            and (
                "duration" in name or "latency" in name or name.endswith(("_ms", "_s", "_seconds"))
            )
        ):
            return "d"
        if isinstance(value, int) and name is not None and name.endswith("port"):
            return "port"
        if isinstance(value, str) and HEX_ID.search(value):
            return HEX_ID.sub(self._id, value)
        if isinstance(value, str) and "127.0.0.1:" in value:
            return LOOPBACK.sub(self._server, value)
        return value

    def _id(self, match: re.Match[str]) -> str:
        return self.ids.setdefault(match.group(), f"id-{len(self.ids)}")

    def _server(self, match: re.Match[str]) -> str:
        """A test server's address: its port is new on every run."""
        return self.ids.setdefault(match.group(), f"server-{len(self.ids)}")


def compare(name: str, actual: Any) -> None:
    path = GOLDEN / f"{name}.json"
    text = orjson.dumps(actual, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    if os.environ.get("TRACE_PROXY_GOLDEN") == "write":
        path.write_bytes(text)
    expected = orjson.loads(path.read_bytes())
    assert len(actual) == len(expected), f"{name}: {len(actual)} items, {len(expected)} expected"
    differences = [
        where
        for position, (got, want) in enumerate(zip(orjson.loads(text), expected, strict=True))
        for where in differing(f"{name}[{position}]", got, want)
    ]
    assert not differences, "\n".join(differences[:40])


def differing(where: str, got: Any, want: Any) -> list[str]:
    """Every path at which `got` and `want` differ, with both values."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            line
            for name in sorted(got.keys() | want.keys())
            for line in differing(
                f"{where}.{name}", got.get(name, "<absent>"), want.get(name, "<absent>")
            )
        ]
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [line for i, (a, b) in enumerate(zip(got, want, strict=True))
                for line in differing(f"{where}[{i}]", a, b)]  # fmt: skip
    return [] if got == want else [f"{where}: {str(got)[:200]!r} != {str(want)[:200]!r}"]


@pytest.fixture(scope="module")
async def golden_run(qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    output = tmp_path_factory.mktemp("golden")
    answers = await run(qwen_tokenizer, str(ensure_qwen_tokenizer()), output)
    return output, answers


async def test_the_records_are_the_golden_ones(golden_run: Any) -> None:
    output, answers = golden_run
    normaliser = Normaliser()
    records = [normaliser.record(r) for r in stored(output)]
    compare("records", records)
    compare("reward-answers", normaliser.record(answers))


async def test_each_backend_renders_them_as_before(golden_run: Any) -> None:
    output, _ = golden_run
    renderings = await backend_renderings(stored(output))
    for backend, items in renderings.items():
        normaliser = Normaliser()
        compare(f"backend-{backend}", [normaliser.record(item) for item in items])


def test_another_machine_renders_them_the_same() -> None:
    """This module's other tests, run where the kernel release and version, the host name, the
    Python build and the reporting packages' versions all differ (golden/another_machine.py),
    still find the golden copies: nothing compared comes from the machine."""
    tests = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRACE_PROXY_GOLDEN"}  # compare, never write
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tests), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", __file__, "-p", "golden.another_machine",
               "-k", "not another_machine", "-q", "-p", "no:cacheprovider"]  # fmt: skip
    ran = subprocess.run(command, cwd=tests.parent, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-2000:]
    assert "2 passed" in ran.stdout, ran.stdout[-2000:]
