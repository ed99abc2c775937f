"""Starting and stopping a `trace-proxy serve` the plugin runs itself, and checking one it
is given.

A proxy the plugin runs (one per node that hosts a rollout server, see fleet.py) is this
interpreter's `trace-proxy serve`, on ports the kernel picks (the same ones again when it is
restarted), accepting upstreams registered with a token made for the run, which it gets in its
environment, never on its command line. It ends with the process that started it (SIGTERM,
so it drains and writes every record first).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from trace_proxy.integrations.verl.settings import TOKEN_ENV

_ADDRESSES = re.compile(r"forwarding (\S+) -> .*metrics at (\S+)/metrics")
STOP_TIMEOUT_S = 60.0


class ProxyStartError(RuntimeError):
    """The proxy could not be started, or a running one could not be reached."""


@dataclass
class LaunchedProxy:
    process: subprocess.Popen[str]
    proxy_url: str
    admin_url: str
    admin_token: str

    def stop(self) -> None:
        """SIGTERM: the proxy finishes in-flight requests and spools every record."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _end_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (Linux), so a trainer
    killed without running its exit handlers does not leave the proxy behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def make_token() -> str:
    """A run's admin token (URL-safe; it may begin with `-`, so it never goes on a command
    line as an option's value: the proxy takes it from its environment)."""
    return secrets.token_urlsafe(32)


def launch(
    args: list[str], timeout: float, token: str | None = None, ports: tuple[int, int] = (0, 0)
) -> LaunchedProxy:
    """Start `trace-proxy serve` and wait until /ready; ProxyStartError with its output if not.
    `ports`: the proxy's and the admin port (0: any free one)."""
    token = token or make_token()
    command = [sys.executable, "-m", "trace_proxy", "serve", "--register-upstreams",
               "--port", str(ports[0]), "--admin-port", str(ports[1]), *args]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, TOKEN_ENV: token},  # never on the command line, where ps shows it
        preexec_fn=_end_with_parent if sys.platform == "linux" else None,
    )
    assert process.stdout is not None
    lines: list[str] = []
    found: list[tuple[str, str]] = []
    announced = threading.Event()

    def read() -> None:  # keeps draining, so the proxy never blocks on a full pipe
        assert process.stdout is not None
        for line in process.stdout:
            if not found:
                lines.append(line)
                match = _ADDRESSES.search(line)
                if match:
                    found.append((match[1], match[2]))
                    announced.set()
            sys.stderr.write("[trace-proxy] " + line)
        announced.set()

    threading.Thread(target=read, name="trace-proxy-output", daemon=True).start()
    launched = None
    if announced.wait(timeout) and found:
        launched = LaunchedProxy(process, found[0][0], found[0][1], token)
    deadline = time.monotonic() + timeout
    while launched is not None and not ready(launched.admin_url):
        if process.poll() is not None or time.monotonic() > deadline:
            launched = None
            break
        time.sleep(0.2)
    if launched is None:
        if process.poll() is None:
            process.kill()
        process.wait()
        output = "".join(lines[-20:]).strip() or "(no output)"
        raise ProxyStartError(f"trace-proxy did not start ({' '.join(command[:4])} ...):\n{output}")
    atexit.register(launched.stop)
    return launched


def register_servers(admin_url: str, token: str | None, server_ids: list[str]) -> None:
    """verl's servers, registered on a proxy under their own ids (their `ip:port`)."""
    for server_id in server_ids:
        request = urllib.request.Request(
            f"{admin_url}/upstreams/{server_id}",
            data=json.dumps({"url": f"http://{server_id}"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            method="PUT",
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            raise ProxyStartError(
                f"trace-proxy refused to register verl's server {server_id}: "
                f"{exc.code} {exc.read()[:500]!r}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ProxyStartError(f"trace-proxy at {admin_url}: {exc}") from None


def ready(admin_url: str) -> bool:
    try:
        with urllib.request.urlopen(admin_url + "/ready", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def check_running(proxy_url: str, admin_url: str, token: str | None) -> None:
    """A proxy given by URL must answer /ready and accept registrations with our token."""
    if not ready(admin_url):
        raise ProxyStartError(
            f"trace-proxy at {admin_url} is not ready (is it running, and started with "
            "--register-upstreams?); fix trace_proxy.url / trace_proxy.admin_url, or drop them "
            "to let the plugin start its own"
        )
    request = urllib.request.Request(admin_url + "/upstreams", method="GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            listing = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise ProxyStartError(f"trace-proxy at {admin_url}: {exc}") from None
    if b'"registered":null' in listing.replace(b" ", b""):
        raise ProxyStartError(
            f"trace-proxy at {proxy_url} was started without --register-upstreams: it cannot "
            "reach verl's servers"
        )
    if token is None:
        raise ProxyStartError(f"the admin token of {admin_url} is needed in ${TOKEN_ENV}")
