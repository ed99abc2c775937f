"""A Docker daemon of the test run's own, started in a work directory and removed after.

Its data (images, layers, volumes) live on a tmpfs: deleting a few hundred MB of layer files
from disk took 10-30 s on a busy machine, unmounting takes none, and builds write to memory.

It changes nothing on the host's network: no default bridge (`docker0`), no iptables rules, no
IP forwarding. Containers run with `--network host` (or none, for builds), which needs none
of that. Stopping it ends dockerd (and the containerd it started), unmounts whatever it left
mounted, and deletes the work directory; a `docker0` or an IP-forwarding change found
afterwards is undone all the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 60.0
NAMESPACE = "trace-proxy-tests"
DATA_SIZE = "4g"  # a tmpfs only takes the memory its files use
STOP_TIMEOUT_S = 30.0
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class DockerError(RuntimeError):
    """A docker command failed; the message has its output."""


class DockerDaemon:
    """`dockerd` with its socket, data and state under one directory."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.socket = work_dir / "docker.sock"
        self.log_path = work_dir / "dockerd.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._ip_forward = IP_FORWARD.read_text() if IP_FORWARD.exists() else None
        self._had_docker0 = Path("/sys/class/net/docker0").exists()

    @property
    def env(self) -> dict[str, str]:
        """For docker commands: this daemon, the classic builder (no BuildKit, no registry)."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def start(self) -> None:
        config = self.work_dir / "daemon.json"
        config.write_text("{}\n")  # not the host's /etc/docker/daemon.json
        data = self.work_dir / "data"
        data.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DATA_SIZE},mode=0710", "tmpfs", str(data)],
            check=True,
        )
        cmd = [
            "dockerd", "--config-file", str(config), "--host", f"unix://{self.socket}",
            "--data-root", str(data), "--exec-root", str(self.work_dir / "exec"),
            "--pidfile", str(self.work_dir / "dockerd.pid"),
            "--bridge", "none", "--iptables=false", "--ip6tables=false", "--ip-forward=false",
            "--ip-masq=false",
            # Where a system containerd runs, dockerd uses it: keep out of its Docker's way.
            "--containerd-namespace", NAMESPACE,
            "--containerd-plugins-namespace", f"{NAMESPACE}-plugins",
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.run("info", check=False).returncode != 0:
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise DockerError(f"dockerd did not start; its log:\n{self.log_tail()}")
            time.sleep(0.2)  # polling the socket for the daemon to answer

    def run(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """One docker command against this daemon; raises with its output when it fails."""
        done = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise DockerError(
                f"`docker {' '.join(args)}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done

    def volume_path(self, volume: str) -> Path:
        """Where a named volume's files are on the host."""
        found = self.run("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout
        return Path(found.strip())

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """End dockerd (it stops its containers and containerd), then leave nothing behind."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._unmount_leftovers()
        if not self._had_docker0 and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "delete", "docker0"], check=False)
        if self._ip_forward is not None and IP_FORWARD.read_text() != self._ip_forward:
            IP_FORWARD.write_text(self._ip_forward)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What a stopped daemon left behind (nothing, once `stop` has run)."""
        found = []
        if self._process is not None and self._process.poll() is None:
            found.append(f"dockerd (pid {self._process.pid}) still running")
        prefix = str(self.work_dir) + "/"
        found += [f"mount {m}" for m in self._mounts() if m.startswith(prefix)]
        if self.work_dir.exists():
            found.append(f"directory {self.work_dir}")
        if not self._had_docker0 and Path("/sys/class/net/docker0").exists():
            found.append("network interface docker0")
        if self._ip_forward is not None and IP_FORWARD.read_text() != self._ip_forward:
            found.append("net.ipv4.ip_forward changed")
        return found

    @staticmethod
    def _mounts() -> list[str]:
        return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]

    def _unmount_leftovers(self) -> None:
        """Mounts under the work dir, deepest first: what a killed daemon left (overlays,
        netns), then the data tmpfs."""
        prefix = str(self.work_dir) + "/"
        for mount in sorted((m for m in self._mounts() if m.startswith(prefix)), reverse=True):
            subprocess.run(["umount", "--lazy", mount], check=False)


@contextlib.contextmanager
def running_daemon() -> Iterator[DockerDaemon]:
    """A started daemon in a fresh short directory (socket paths must stay under 108 bytes)."""
    daemon = DockerDaemon(Path(tempfile.mkdtemp(prefix="trace-proxy-docker-")))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()
