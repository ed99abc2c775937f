"""verl's CPU runs (`verl_harness/run.py`, `verl_harness/cluster.py`, in verl's venv) as processes
of the test session.

It takes about two minutes, most of it Ray and verl's workers starting. Its results depend on
nothing but the real vLLM server, and other tests sending to that server at the same time could
change what vLLM batches together, so verl's tests run last (`order_items`) and the run starts
with the first test after the last one that uses the real vLLM server (the root conftest): it
overlaps the unit tests, which use fakes, instead of adding to the session. verl's module
fixture waits for it, or starts it when nothing did (verl's tests alone).

Each run starts a Ray cluster of its own and touches no other: Ray joins a cluster it finds
through `RAY_ADDRESS` or through the address file in its temp directory
(`/tmp/ray/ray_current_cluster`, which `ray start` and `ray.cluster_utils.Cluster` write), points
that directory's `session_latest` at its newest session, and reads (or creates) a token in
`~/.ray/auth_token`. So a run has `RAY_ADDRESS` unset, a temp directory of its own
(`RAY_TMPDIR`, from which Ray derives every default path, in the run and the Ray processes it
starts), a token of its own in its environment, and starts Ray with `address="local"`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from .hostile import is_hostile_test
from .provision import provision
from .servers import REAL_TESTS_DIR, RealServer, stop_group

REPO = REAL_TESTS_DIR.parent.parent
VERL_TESTS = REAL_TESTS_DIR / "test_verl_plugin.py"
# verl's fully async rollouter: its own run, started by its module fixture after verl's tests
# (so that its traffic to the vLLM server never overlaps the runs they compare)
FULLY_ASYNC_TESTS = REAL_TESTS_DIR / "test_verl_fully_async.py"
CLUSTER_TESTS = REAL_TESTS_DIR / "test_verl_cluster.py"
RUN_TIMEOUT_S = 1500.0
STOP_GRACE_S = 10.0


def is_verl_test(item: pytest.Item) -> bool:
    return item.path.resolve() == VERL_TESTS


def is_fully_async_test(item: pytest.Item) -> bool:
    return item.path.resolve() == FULLY_ASYNC_TESTS


def uses_real_vllm(item: pytest.Item) -> bool:
    return (
        "real_vllm" in getattr(item, "fixturenames", ())
        and not is_verl_test(item)
        and not is_fully_async_test(item)
    )


class VerlRun:
    """The session's one run: started once, waited on by verl's tests, stopped at the end."""

    def __init__(self) -> None:
        self.start_with: pytest.Item | None = None  # the test it starts before (order_items)
        self.work: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._started_at = 0.0
        self._failed: str | None = None  # why it could not be started
        self._ray_dir: str | None = None  # the run's Ray temp directory

    @property
    def started(self) -> bool:
        return self._process is not None or self._failed is not None

    def order_items(self, items: list[pytest.Item]) -> None:
        """verl's tests last, and after them the hostile environment's (which waits for its
        session, handed the vLLM server once verl's runs are done with it: hostile.py); the run
        to start with the first test after the last other one that uses the real vLLM server
        (None: no test comes between, verl's fixture starts it)."""
        verl = [item for item in items if is_verl_test(item)]
        fully_async = [item for item in items if is_fully_async_test(item)]
        cluster = [item for item in items if is_cluster_test(item)]
        hostile = [item for item in items if is_hostile_test(item)]
        at_the_end = verl + fully_async + cluster + hostile
        items[:] = [item for item in items if item not in at_the_end]
        items += at_the_end
        if not any(item.get_closest_marker("skip") is None for item in verl):
            return
        last = max((i for i, item in enumerate(items) if uses_real_vllm(item)), default=-1)
        following = next(item for item in items[last + 1 :] if not item.get_closest_marker("skip"))
        self.start_with = (
            None
            if is_verl_test(following)
            or is_cluster_test(following)
            or is_fully_async_test(following)
            else following
        )

    def start(self, vllm: RealServer, work: Path) -> None:
        (work / "vllm-url").write_text(vllm.base_url)
        provisioned = provision()
        self._launch(["verl_harness.run", vllm.base_url, str(vllm.model_dir), str(work)], work,
                     provisioned.verl_python)  # fmt: skip

    def _launch(self, arguments: list[str], work: Path, python: Path, nice: int = 0) -> None:
        self.work = work
        # Short: the paths of Ray's sockets under it must fit in 107 bytes.
        self._ray_dir = tempfile.mkdtemp(prefix="ray-")
        env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        env.update({"PYTHONPATH": f"{REPO}{os.pathsep}{REAL_TESTS_DIR}", "HF_HUB_OFFLINE": "1",
                    "RAY_DEDUP_LOGS": "0", "RAY_TMPDIR": self._ray_dir, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)})  # fmt: skip
        self._log = (work / "run.log").open("wb")
        self._started_at = time.monotonic()
        self._process = subprocess.Popen(
            [str(python), "-m", *arguments], stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip

    @property
    def exited(self) -> bool:
        """Started, and no longer running (whatever its exit code: its tests judge it)."""
        return self._failed is not None or (
            self._process is not None and self._process.poll() is not None
        )

    def could_not_start(self, why: str) -> None:
        self._failed = why

    def wait(self) -> Path:
        """The run's work directory once it has exited 0; a test failure otherwise."""
        if self._failed is not None:
            pytest.fail(f"the verl run could not be started: {self._failed}", pytrace=False)
        assert self._process is not None and self.work is not None
        left = RUN_TIMEOUT_S - (time.monotonic() - self._started_at)
        try:
            code = self._process.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the verl run took over {RUN_TIMEOUT_S:.0f} s", pytrace=False)
        if code != 0:
            log = self.work / "run.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
            pytest.fail(f"the verl run exited {code}; last lines of {log}:\n{tail}", pytrace=False)
        return self.work

    def stop(self) -> None:
        """At the session's end (or past its timeout): the run and every process it started
        (Ray's), if still running."""
        process = self._process
        if process is not None:
            stop_group(process, STOP_GRACE_S)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._ray_dir is not None:
            shutil.rmtree(self._ray_dir, ignore_errors=True)
            self._ray_dir = None


class ClusterRun(VerlRun):
    """The cluster run (`verl_harness/cluster.py`): it needs no real server, so it starts with
    the session's first test, at a lower priority than the tests it overlaps, and its tests
    run last."""

    def start_if_selected(self, items: list[pytest.Item], work: Path) -> None:
        if not any(is_cluster_test(i) and not i.get_closest_marker("skip") for i in items):
            return
        try:
            provisioned = provision()
            self._launch(["verl_harness.cluster", str(provisioned.model_dir), str(work)], work,
                         provisioned.verl_python, nice=10)  # fmt: skip
        except Exception as exc:
            self.could_not_start(repr(exc))


def is_cluster_test(item: pytest.Item) -> bool:
    return item.path.resolve() == CLUSTER_TESTS


class FullyAsyncRun(VerlRun):
    """The fully async run (`verl_harness/fully_async.py`): it sends to the real vLLM server
    too, so it starts once verl's run has exited (its comparisons never share the server), in
    the background beside the tests still running, or in its tests' fixture when nothing
    started it."""

    def start(self, vllm: RealServer, work: Path) -> None:
        provisioned = provision()
        self._launch(["verl_harness.fully_async", vllm.base_url, str(vllm.model_dir),
                      str(work)], work, provisioned.verl_python)  # fmt: skip


VERL_RUN = VerlRun()
CLUSTER_RUN = ClusterRun()
FULLY_ASYNC_RUN = FullyAsyncRun()
