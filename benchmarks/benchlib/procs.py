"""Starting, watching and stopping the processes of a run: upstream, trace-proxy, nginx.

Every process logs to a file in the work directory (no pipes that could fill up and stall it),
announces readiness with a line the parent waits for (bounded), and is stopped by its own pid
with SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NGINX_PACKAGE = "nginx"


class BenchError(RuntimeError):
    """A setup problem the user must fix; printed as one line."""


@dataclass(frozen=True)
class Placement:
    """Which CPUs the load side (load generator and upstream) and the system under test (every
    process of it) may run on. Apart, a proxy is measured as a sidecar with cores of its own,
    as on a GPU node, rather than by how much CPU it takes from the client and the server."""

    load: frozenset[int] | None = None
    system: frozenset[int] | None = None

    @property
    def pinned(self) -> bool:
        return self.load is not None

    def describe(self) -> str:
        if self.load is None or self.system is None:
            return "not pinned: every process may run on every core"
        return (
            f"load generator and upstream on CPU {_cpu_list(self.load)}, the system under test "
            f"(all its processes) on CPU {_cpu_list(self.system)}"
        )


def parse_placement(text: str) -> Placement:
    """`auto`: the CPUs this process may use, split in two halves (not pinned with fewer than
    2); `off`; or `LOAD:SYSTEM` as CPU lists, `0:1` or `0-3:4-7`."""
    if text == "off":
        return Placement()
    if text == "auto":
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return Placement()
        half = len(cpus) // 2
        return Placement(frozenset(cpus[:half]), frozenset(cpus[half:]))
    load_text, sep, system_text = text.partition(":")
    try:
        load, system = _parse_cpus(load_text), _parse_cpus(system_text)
    except ValueError:
        sep = ""
    if not sep:
        raise BenchError(f"--pin takes auto, off or LOAD:SYSTEM CPU lists (0:1), not {text!r}")
    usable = os.sched_getaffinity(0)
    if not load | system <= usable or load & system:
        raise BenchError(
            f"--pin {text}: the two sides need separate CPUs among {_cpu_list(usable)}"
        )
    return Placement(load, system)


def _parse_cpus(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(text)
    return frozenset(cpus)


def _cpu_list(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def pinned_to(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """For Popen's `preexec_fn`: the child (and what it starts) runs on these CPUs only."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def run_on(procs: list[Proc], cpus: frozenset[int] | None) -> None:
    """Move running processes (every thread of each, and their children) to these CPUs (None:
    every CPU this process may use)."""
    allowed = cpus if cpus is not None else os.sched_getaffinity(0)
    for proc in procs:
        for pid in proc.pids():
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(task), allowed)


def stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, a job runner) unwinds the run like Ctrl-C, so the processes it
    started are stopped instead of left running against the next run's work directory."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def pids(self) -> list[int]:
        """The process and its descendants (nginx's workers; trace-proxy's capture process and
        the export process under it), parents before children."""
        found = [self.popen.pid]
        for pid in found:
            found.extend(_children(pid))
        return found

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids())

    def peak_rss_mib(self) -> float:
        """Peak resident memory (VmHWM) of the process and its children, in MiB."""
        return sum(peak_rss_kib(pid) for pid in self.pids()) / 1024

    def stop(self, grace: float = 60.0) -> tuple[int, float]:
        """SIGTERM, wait up to `grace` seconds (then SIGKILL); return (exit code, seconds)."""
        start = time.monotonic()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode, time.monotonic() - start


def child_env() -> dict[str, str]:
    """The parent's environment minus TRACE_PROXY_* (so only our flags configure the proxy)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_DIR), env.get("PYTHONPATH")]))
    return env


def spawn(
    name: str,
    argv: list[str],
    workdir: Path,
    source: Path | None = None,
    cpus: frozenset[int] | None = None,
) -> Proc:
    """`source`: a checkout whose `trace_proxy` is imported instead of the installed one;
    `cpus`: where it and its children may run (all CPUs if None)."""
    log = workdir / f"{name}.log"
    env = child_env()
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), env["PYTHONPATH"]])
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=workdir,  # `-m` puts the cwd first on sys.path: no stray checkout shadows imports
            preexec_fn=pinned_to(cpus),
        )
    return Proc(name, popen, log)


def wait_for_line(proc: Proc, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    """Poll the process's log until `pattern` matches; fail with the log's tail if it exits."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.log.read_text(errors="replace")
        if match := regex.search(text):
            return match
        if proc.popen.poll() is not None:
            break
        time.sleep(0.05)
    tail = proc.log.read_text(errors="replace")[-2000:]
    raise BenchError(f"{proc.name} did not become ready (exit code {proc.popen.poll()}):\n{tail}")


def wait_for_port(proc: Proc, port: int, timeout: float = 30.0) -> None:
    """For processes with no ready line (nginx): wait until the port accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    tail = proc.log.read_text(errors="replace")[-2000:]
    raise BenchError(f"{proc.name} is not listening on {port} (exit {proc.popen.poll()}):\n{tail}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_upstream(
    workdir: Path,
    turns: int,
    seed: int,
    chunk_interval_ms: float = 0.0,
    prompt_sizes: list[int] | None = None,
    cpus: frozenset[int] | None = None,
) -> tuple[Proc, str]:
    argv = [sys.executable, "-m", "benchlib.upstream", "--port", "0", "--turns", str(turns),
            "--seed", str(seed), "--chunk-interval-ms", str(chunk_interval_ms)]  # fmt: skip
    if prompt_sizes:
        argv += ["--prompt-tokens", ",".join(map(str, prompt_sizes))]
    proc = spawn("upstream", argv, workdir, cpus=cpus)
    port = wait_for_line(proc, r"upstream listening on (\d+)").group(1)
    return proc, f"http://127.0.0.1:{port}"


def trace_proxy_argv(upstream: str, store: Path, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "trace_proxy", "serve", "--upstream", upstream, "--port", "0",
            "--admin-port", "0", "--output", str(store), *(extra or [])]  # fmt: skip


def start_trace_proxy(
    workdir: Path,
    upstream: str,
    name: str = "trace-proxy",
    extra: list[str] | None = None,
    source: Path | None = None,
    cpus: frozenset[int] | None = None,
) -> tuple[Proc, str, str]:
    """Returns the process, its proxy URL and its admin URL (both from its ready line)."""
    store = workdir / ("store" if name == "trace-proxy" else f"store-{name}")
    proc = spawn(name, trace_proxy_argv(upstream, store, extra), workdir, source, cpus)
    match = wait_for_line(proc, r"trace-proxy: forwarding (\S+) -> .*metrics at (\S+)/metrics")
    wait_until_ready(proc, match.group(2))
    return proc, match.group(1), match.group(2)


def wait_until_ready(proc: Proc, admin: str, timeout: float = 120.0) -> None:
    """The proxy listens before its helper processes are up: measured only once `/ready` says
    200 (a version without `/ready`, 404, was ready when it printed its line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(admin + "/ready", timeout=5):
                return
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return
        except OSError:
            pass
        if proc.popen.poll() is not None:
            break
        time.sleep(0.1)
    tail = proc.log.read_text(errors="replace")[-2000:]
    raise BenchError(f"{proc.name} did not become ready (exit code {proc.popen.poll()}):\n{tail}")


def find_nginx() -> str:
    """nginx from PATH or /usr/sbin (not on a normal user's PATH); a clear error if absent."""
    path = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if path is None:
        raise BenchError(
            f"nginx not found: install the Debian package '{NGINX_PACKAGE}' "
            f"(apt-get install -y {NGINX_PACKAGE}), or leave nginx out: "
            "--systems direct,trace-proxy"
        )
    return path


def nginx_config(prefix: Path, port: int, upstream: str) -> str:
    """A plain keep-alive reverse proxy, no buffering, no logging: the reference to beat."""
    host_port = upstream.removeprefix("http://")
    return f"""\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_max_body_size 0;
    upstream inference {{
        server {host_port};
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://inference;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def start_nginx(
    workdir: Path, upstream: str, cpus: frozenset[int] | None = None
) -> tuple[Proc, str, Path]:
    """Foreground nginx (`daemon off`) with everything under workdir/nginx; returns its URL."""
    binary = find_nginx()
    prefix = workdir / "nginx"
    prefix.mkdir()
    prefix.chmod(0o755)  # nginx's worker may run as an unprivileged user when we are root
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_config(prefix, port, upstream))
    argv = [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf),
            "-g", "daemon off;"]  # fmt: skip
    proc = spawn("nginx", argv, workdir, cpus=cpus)
    wait_for_port(proc, port)
    return proc, f"http://127.0.0.1:{port}", prefix / "error.log"


def nginx_version(binary: str) -> str:
    result = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    return (result.stderr or result.stdout).strip().removeprefix("nginx version: nginx/")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads), from /proc; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


def machine_busy_seconds() -> float:
    """CPU seconds spent not idle by the whole machine since boot (every core, every process)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            children.append(int(entry.name))
    return children
