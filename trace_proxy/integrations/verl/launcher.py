"""Starting and stopping a `trace-proxy serve` the plugin runs itself, and checking one it
is given.

A proxy the plugin runs (one per node that hosts a rollout server, see fleet.py) is this
interpreter's `trace-proxy serve`, on ports the kernel picks (the same ones again when it is
restarted), accepting upstreams registered with a token made for the run, which it gets in its
environment, never on its command line. It is started detached (processes/detach.py): not the
child of the Ray actor that starts it, in a session of its own, so Ray's killing of the actor's
children and process group when the job ends does not reach it. It ends with that actor all
the same: on `stop` (SIGTERM), or when the actor dies however it dies (its lifeline pipe closes),
draining first, within a bound, so every record it holds is written.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from trace_proxy.integrations.verl.settings import TOKEN_ENV
from trace_proxy.processes.detach import DetachedProcess, lifeline_pipe, start

_ADDRESSES = re.compile(r"forwarding (\S+) -> .*metrics at (\S+)/metrics")
STOP_TIMEOUT_S = 60.0


class ProxyStartError(RuntimeError):
    """The proxy could not be started, or a running one could not be reached."""


@dataclass
class LaunchedProxy:
    process: DetachedProcess
    proxy_url: str
    admin_url: str
    admin_token: str

    def stop(self) -> None:
        """SIGTERM: the proxy finishes in-flight requests and spools every record."""
        if self.process.running():
            self.process.send_signal(signal.SIGTERM)
            if not self.process.wait(STOP_TIMEOUT_S):
                self.process.send_signal(signal.SIGKILL)
                self.process.wait()
        self.process.release()


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
    lifeline = lifeline_pipe()
    command = [sys.executable, "-m", "trace_proxy", "serve", "--register-upstreams",
               "--port", str(ports[0]), "--admin-port", str(ports[1]), *args,
               "--lifeline-fd", str(lifeline[0])]  # fmt: skip
    env = {**os.environ, TOKEN_ENV: token}  # never on the command line, where ps shows it
    try:
        process = start(command, lifeline, env)
    except OSError as exc:
        raise ProxyStartError(f"trace-proxy did not start: {exc}") from None
    lines: list[str] = []
    found: list[tuple[str, str]] = []
    announced = threading.Event()

    def read() -> None:  # keeps draining, so the proxy never blocks on a full pipe
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
        if not process.running() or time.monotonic() > deadline:
            launched = None
            break
        time.sleep(0.2)
    if launched is None:
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.release()
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
