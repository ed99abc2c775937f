"""The machine and software a run happened on, for RESULTS.md (numbers mean little without)."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from benchlib.aio import loop_name
from benchlib.procs import find_nginx, nginx_version

REPO = Path(__file__).resolve().parents[2]


def describe(with_nginx: bool) -> dict[str, str]:
    load = os.getloadavg()
    info = {
        "cores": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "memory": _memory(),
        "kernel": f"{platform.system()} {platform.release()}",
        "load average at start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "python": platform.python_version(),
        "loop": loop_name(),
        "packages": ", ".join(f"{p} {_version(p)}" for p in ("aiohttp", "orjson", "yarl")),
        "trace-proxy": f"{_version('trace-proxy')} ({_source()})",
    }
    if with_nginx:
        info["nginx"] = nginx_version(find_nginx())
    return info


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.machine()


def _memory() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    return "?"


def _source() -> str:
    """Which trace_proxy code runs: this checkout's commit (and whether trace_proxy/ differs
    from it), or the directory it is imported from when PYTHONPATH points elsewhere."""
    spec = importlib.util.find_spec("trace_proxy")
    if spec is None or spec.origin is None:
        return "not importable"
    package = Path(spec.origin).resolve().parent
    if package.parent != REPO:
        return f"imported from {package}"
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"imported from {package}, not a git checkout"
    dirty = _git("status", "--porcelain", "--untracked-files=all", "--", "trace_proxy")
    return f"git {commit}" + (", with uncommitted changes in trace_proxy/" if dirty else "")


def _git(*args: str) -> str:
    """Read-only git (no index refresh, so it never races a concurrent commit)."""
    result = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return result.stdout.strip() if result.returncode == 0 else ""
