"""A second lane for the whole suite: some packages' tests run in a pytest of their own, started
with the session, beside the container's and the real servers' tests, which mostly wait on
servers and subprocesses. Their reports come back in the session's order, at its end, as if
they had run there: each with its outcome, output and duration, so the session passes, fails and
lists its slowest tests as one.

Only a run of the whole suite takes a lane (no paths, no `-k`, `-m` or `--lf`): a narrower run
has nothing to overlap. `TRACE_PROXY_TEST_ONE_LANE=1` keeps every test in the session. The lane
shares nothing with the session but the machine: it starts no real server (its packages use
none), its temporary files are under the session's, and it inherits the session's environment,
already cleared of the machine's settings (isolation.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

TESTS = Path(__file__).resolve().parent.parent
# The packages whose tests take the lane: about half the unit tests' time.
LANE_PACKAGES = ("text", "processes", "dataset", "demo", "replay", "exporters")
ONE_LANE_ENV = "TRACE_PROXY_TEST_ONE_LANE"
POLL_S = 0.2
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 6000
_LANE = pytest.StashKey["Lane"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lane-reports", help="(the suite's own) where a lane writes its reports")


def _whole_suite(config: pytest.Config) -> bool:
    option = config.option
    return (
        config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not option.keyword
        and not option.markexpr
        and not getattr(option, "lf", False)  # cacheprovider may be off
        and not option.collectonly
        and os.environ.get(ONE_LANE_ENV) != "1"
    )


def _in_lane(item: pytest.Item) -> bool:
    parents = item.path.resolve().parents
    return any(TESTS / package in parents for package in LANE_PACKAGES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lane's tests last in the session's order: their reports are read there."""
    if not _whole_suite(config):
        return
    lane = [item for item in items if _in_lane(item)]
    if lane and len(lane) < len(items):
        items[:] = [item for item in items if not _in_lane(item)] + lane
        config.stash[_LANE] = Lane({item.nodeid for item in lane})


def pytest_collection_finish(session: pytest.Session) -> None:
    lane = session.config.stash.get(_LANE, None)
    if lane is not None:
        factory: Any = session.config._tmp_path_factory  # type: ignore[attr-defined]
        lane.start(session.config.rootpath, factory.mktemp("lane"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    lane = item.config.stash.get(_LANE, None)
    if lane is None or item.nodeid not in lane.nodeids:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for data in lane.reports_of(item.nodeid):
        report = item.config.hook.pytest_report_from_serializable(config=item.config, data=data)
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    lane = session.config.stash.get(_LANE, None)
    if lane is not None:
        lane.stop()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--lane-reports")
    if path:  # this is the lane's own pytest
        config.pluginmanager.register(ReportWriter(config, Path(path)), "lane-report-writer")


class ReportWriter:
    """In the lane's pytest: each report written as it is made, for the session to read."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self._config = config
        self._file = path.open("a", encoding="utf-8")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        hook = self._config.hook
        data = hook.pytest_report_to_serializable(config=self._config, report=report)
        self._file.write(json.dumps(data) + "\n")
        self._file.flush()

    def pytest_unconfigure(self) -> None:
        self._file.close()


class Lane:
    """The lane's pytest, and the reports it has written so far, by test."""

    def __init__(self, nodeids: set[str]) -> None:
        self.nodeids = nodeids
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None
        self._reports: IO[str] | None = None
        self._read: dict[str, list[dict[str, Any]]] = {}
        self._done: set[str] = set()  # tests whose teardown report has come
        self._partial = ""

    def start(self, rootpath: Path, work: Path) -> None:
        reports, self._log = work / "reports.jsonl", work / "lane.log"
        reports.touch()
        paths = [str(TESTS / package) for package in LANE_PACKAGES]
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--basetemp",
                   str(work / "tmp"), "--lane-reports", str(reports), *paths]  # fmt: skip
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                command, cwd=rootpath, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self._reports = reports.open(encoding="utf-8")

    def reports_of(self, nodeid: str) -> list[dict[str, Any]]:
        """The test's reports (setup, call, teardown) once its teardown is in; a failure saying
        why when the lane ended without them."""
        assert self._process is not None
        while True:
            ended = self._process.poll() is not None  # before reading: then all is written
            self._read_more()
            if nodeid in self._done:
                return self._read.pop(nodeid)
            if ended:
                return self._missing(nodeid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=POLL_S)

    def _read_more(self) -> None:
        assert self._reports is not None
        self._partial += self._reports.read()
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            data = json.loads(line)
            nodeid = data["nodeid"]
            self._read.setdefault(nodeid, []).append(data)
            if data.get("when") == "teardown":
                self._done.add(nodeid)

    def _missing(self, nodeid: str) -> list[dict[str, Any]]:
        assert self._process is not None and self._log is not None
        tail = self._log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        why = f"the lane's pytest exited {self._process.returncode} without this test's reports"
        location = (nodeid.split("::", 1)[0], None, nodeid)
        common = {"$report_type": "TestReport", "nodeid": nodeid, "location": location,
                  "keywords": {}, "sections": [], "user_properties": []}  # fmt: skip
        return [
            *self._read.pop(nodeid, []),
            {**common, "outcome": "failed", "when": "call", "longrepr": f"{why}:\n{tail}"},
            {**common, "outcome": "passed", "when": "teardown", "longrepr": None},
        ]

    def stop(self) -> None:
        """At the session's end: the lane, if still running, and what it started."""
        process = self._process
        if process is not None and process.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_GRACE_S)
                    break
        if self._reports is not None:
            self._reports.close()
