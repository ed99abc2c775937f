"""Real vLLM (CPU build) and real `transformers serve` on a tiny model, run for a test session.

Fakes can only be as faithful as our reading of the servers; these give the proxy's tests the
real thing. Only the servers the selected tests use are started, all of them before the first
test of the session (vLLM alone needs over a minute, which then overlaps the tests before the
first real one) and before either is waited on; their whole process groups are stopped at
session end. The fixtures are in the root conftest.py (the launch) and in conftest.py here.

A pytest session that a test starts (hostile.py) may be handed the session's
running servers instead of starting its own (`handed_over_env`): it takes them only from the
process that started it, and never stops them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

import pytest

from .provision import Provisioned, provision

REAL_TESTS_DIR = Path(__file__).resolve().parent
SKIP_ENV = "TRACE_PROXY_SKIP_REAL"
STARTUP_TIMEOUT_ENV = "TRACE_PROXY_REAL_STARTUP_TIMEOUT"
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # vLLM takes 55-72 s alone; generous for a loaded 2-core CI
STOP_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.5
LOG_TAIL_LINES = 60
VLLM_MODEL_NAME = "tiny-qwen"
# Set only by a test for the pytest session it starts; support/isolation.py keeps it.
HANDED_OVER_ENV = "TRACE_PROXY_TEST_HANDED_OVER"


@dataclass(frozen=True)
class RealServer:
    """What a test needs to talk to one running server."""

    base_url: str  # e.g. http://127.0.0.1:40123 (no trailing slash, no /v1)
    model: str  # the `model` to send in requests
    model_dir: Path  # the tiny model; its tokenizer is the real Qwen one
    log_path: Path  # the server's combined stdout/stderr


@dataclass
class _Launched:
    """A started server process, not yet known to be healthy."""

    name: str
    server: RealServer
    process: subprocess.Popen[bytes] | None  # None: handed over, its starter's to stop
    log_file: IO[bytes] | None
    started_at: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _launch(name: str, cmd: list[str], env: dict[str, str], server: RealServer) -> _Launched:
    """Start in a new session so that stopping can signal every child (vLLM's engine core)."""
    log_file = server.log_path.open("wb")
    try:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            start_new_session=True,
        )
    except OSError:
        log_file.close()
        raise
    return _Launched(name, server, process, log_file, time.monotonic())


def _launch_vllm(provisioned: Provisioned, work_dir: Path) -> _Launched:
    port = _free_port()
    cmd = [
        str(provisioned.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(provisioned.model_dir), "--served-model-name", VLLM_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager", "--enable-scale-out",
        # `/load`: requests inside the server, counted while its engine is frozen too.
        "--enable-server-load-tracking",
        # Makes the random model call verl's test tool when offered it; no other prompt changes.
        "--logits-processors", "verl_harness.scripted_tool_call:ScriptedToolCall",
    ]  # fmt: skip
    server = RealServer(
        base_url=f"http://127.0.0.1:{port}",
        model=VLLM_MODEL_NAME,
        model_dir=provisioned.model_dir,
        log_path=work_dir / "vllm.log",
    )
    # VLLM_SERVER_DEV_MODE: /pause and /resume, which verl's server actor calls in-process
    # around a weight sync (its stand-in, verl_harness/server.py, calls them over HTTP).
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REAL_TESTS_DIR),
           "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
    return _launch("vLLM", cmd, env, server)


def _launch_transformers_serve(provisioned: Provisioned, work_dir: Path) -> _Launched:
    port = _free_port()
    model = str(provisioned.model_dir)
    cmd = [
        str(provisioned.serve_bin), "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
    ]  # fmt: skip
    hub_cache = work_dir / "hf-hub-cache"  # must exist, even offline
    hub_cache.mkdir(exist_ok=True)
    server = RealServer(
        base_url=f"http://127.0.0.1:{port}",
        model=model,
        model_dir=provisioned.model_dir,
        log_path=work_dir / "transformers-serve.log",
    )
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    return _launch("transformers serve", cmd, env, server)


LAUNCHERS: dict[str, Callable[[Provisioned, Path], _Launched]] = {
    "real_vllm": _launch_vllm,
    "transformers_serve": _launch_transformers_serve,
}


def _handed_over(name: str) -> RealServer | None:
    """The server `name` that the process which started this session handed over to it, if any.

    The handover names its giver, so a value left in a shell (which this session's parent would
    not have given) is never taken: only a server started by the suite's own parent session is.
    """
    given = json.loads(os.environ.get(HANDED_OVER_ENV) or "{}")
    if given.get("parent") != os.getppid() or name not in given.get("servers", {}):
        return None
    fields = given["servers"][name]
    return RealServer(
        base_url=fields["base_url"],
        model=fields["model"],
        model_dir=Path(fields["model_dir"]),
        log_path=Path(fields["log_path"]),
    )


def _is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # not listening yet, or 503 while the engine starts


def _startup_timeout() -> float:
    return float(os.environ.get(STARTUP_TIMEOUT_ENV) or DEFAULT_STARTUP_TIMEOUT_S)


def _wait_healthy(launched: _Launched) -> RealServer:
    """Poll /health until 200; fail fast with the log tail if the process dies or time runs out.

    Waiting on the process between polls doubles as the poll interval and notices a crash at once.
    """
    deadline = launched.started_at + _startup_timeout()
    while not _is_healthy(launched.server.base_url):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _fail(launched, f"not healthy after {_startup_timeout():.0f} s")
        if launched.process is None:  # handed over healthy: it is not starting, it has failed
            _fail(launched, "handed over by the session that started this one, not healthy")
        try:
            code = launched.process.wait(timeout=min(HEALTH_POLL_S, remaining))
        except subprocess.TimeoutExpired:
            continue
        _fail(launched, f"exited with code {code} before becoming healthy")
    elapsed = time.monotonic() - launched.started_at
    url = launched.server.base_url
    how = "handed over" if launched.process is None else f"{elapsed:.1f} s after launch"
    print(f"\n[real] {launched.name} healthy at {url} (first needed {how})")
    return launched.server


def _fail(launched: _Launched, why: str) -> NoReturn:
    if launched.log_file is not None:
        launched.log_file.flush()
    log = launched.server.log_path
    pytest.fail(f"{launched.name} {why}; last lines of {log}:\n{_tail(log)}", pytrace=False)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(process.pid, sig)


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """A process started in a session of its own, and everything it started, if still running:
    SIGTERM the group, SIGKILL it after `grace_s`."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _stop(launched: _Launched) -> None:
    """SIGTERM the group (lets vLLM stop its engine core), SIGKILL whatever is left; a server
    handed over is left to the session that started it."""
    if launched.process is None or launched.log_file is None:
        return
    _signal_group(launched.process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        launched.process.wait(timeout=STOP_TIMEOUT_S)
    _signal_group(launched.process, signal.SIGKILL)
    launched.process.wait()
    launched.log_file.close()


class RealServers:
    """The session's server processes: launched together before the first test, so that their
    start-up (vLLM alone needs over a minute) overlaps the tests that run before the first real
    one; waited on by the first test that needs each, stopped together at session end.
    Provisioning is checked only when a selected test needs something provisioned."""

    def __init__(self, make_work_dir: Callable[[], Path]) -> None:
        self._make_work_dir = make_work_dir  # for the servers' logs; made on first launch
        self._work_dir: Path | None = None
        self._provisioned: Provisioned | None = None
        self._launched: dict[str, _Launched] = {}

    @property
    def provisioned(self) -> Provisioned:
        if self._provisioned is None:
            self._provisioned = provision()
        return self._provisioned

    def launch(self, name: str) -> _Launched:
        if name not in self._launched:
            handed_over = _handed_over(name)
            if handed_over is not None:
                self._launched[name] = _Launched(name, handed_over, None, None, time.monotonic())
                return self._launched[name]
            self._work_dir = self._work_dir or self._make_work_dir()
            self._launched[name] = LAUNCHERS[name](self.provisioned, self._work_dir)
        return self._launched[name]

    def wait_healthy(self, name: str) -> RealServer:
        return _wait_healthy(self.launch(name))

    def handed_over_env(self, name: str) -> dict[str, str]:
        """The environment for a pytest session this process starts, in which the tests that
        use the server `name` use this session's, healthy (waited on here), instead of one of
        its own: a start-up saved, and a machine that cannot hold two of them."""
        server = self.wait_healthy(name)
        fields = {"base_url": server.base_url, "model": server.model,
                  "model_dir": str(server.model_dir), "log_path": str(server.log_path)}  # fmt: skip
        return {HANDED_OVER_ENV: json.dumps({"parent": os.getpid(), "servers": {name: fields}})}

    def stop_all(self) -> None:
        """Stop every server; a test that needs one later launches it again."""
        for launched in self._launched.values():
            _stop(launched)
        self._launched.clear()


def servers_used(items: list[pytest.Item]) -> list[str]:
    """Server fixtures the tests that will run use, directly or through other fixtures."""
    used = {
        name
        for item in items
        if item.get_closest_marker("skip") is None
        for name in getattr(item, "fixturenames", ())
    }
    return [name for name in LAUNCHERS if name in used]


@contextlib.contextmanager
def real_servers(
    items: list[pytest.Item], make_work_dir: Callable[[], Path]
) -> Iterator[RealServers]:
    """Launch every server `items` use at once, so start-ups overlap; stop them all at exit."""
    servers = RealServers(make_work_dir)
    try:
        for name in servers_used(items):
            servers.launch(name)
        yield servers
    finally:
        servers.stop_all()
