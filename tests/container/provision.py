"""Provision what the container tests need: Docker and debootstrap, and a base image's rootfs.

No container registry is reachable from CI, so `FROM python:3.11-slim-bookworm` cannot be
pulled. This module installs Docker and debootstrap from Debian's packages when they are
missing, and builds a stand-in for that base image once, into the test cache: a minimal
Debian bookworm (the same release as the real image) with python3 and venv, made by
debootstrap from the mirror apt is configured with, stored as a tarball that the tests
`docker import` under the real image's name (about 2 s). The tarball is renamed into place
only once complete, and the cache's lock keeps two sessions from building it at once.

    python tests/container/provision.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `real` when run as a script

from real.provision import ProvisionError, default_cache_dir, locked

SUITE = "bookworm"  # python:3.11-slim-bookworm's Debian release
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
HOST_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
BASE_IMAGE = "python:3.11-slim-bookworm"  # the FROM of docker/Dockerfile
ROOTFS_NAME = f"base-rootfs-{SUITE}-v1.tar.gz"  # bump the suffix when BASE_PACKAGES change
APT_LOCK_TIMEOUT_S = 600


class CannotProvision(ProvisionError):
    """This machine cannot run Docker at all (not root, no apt): the tests skip, saying why."""


def _log(message: str) -> None:
    print(f"[provision:container] {message}", flush=True)


def container_cache(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()).expanduser().resolve() / "container"


def missing_host_tools() -> list[str]:
    """Debian packages to install for the commands the tests need."""
    return [pkg for cmd, pkg in HOST_PACKAGES.items() if shutil.which(cmd) is None]


def ensure_host_tools() -> None:
    """apt-get install what is missing (as CI does on a fresh machine)."""
    missing = missing_host_tools()
    if not missing:
        return
    if os.geteuid() != 0:
        raise CannotProvision(f"{', '.join(missing)} missing and not root to install them")
    if shutil.which("apt-get") is None:
        raise CannotProvision(f"{', '.join(missing)} missing and no apt-get to install them")
    _log(f"installing {' '.join(missing)} with apt-get")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = f"DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"
    install = ["apt-get", "install", "-y", "-q", "-o", lock, "--no-install-recommends"]
    for cmd in (["apt-get", "update", "-q", "-o", lock], [*install, *missing]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ProvisionError(f"`{' '.join(cmd)}` exited {done.returncode}:\n{done.stderr}")
    _log(f"installed in {time.monotonic() - started:.1f} s")


def apt_mirror(suite: str = SUITE) -> str:
    """The Debian mirror apt is configured with for `suite` (never one written here)."""
    sources = Path("/etc/apt/sources.list.d")
    texts = [p.read_text() for p in sorted(sources.glob("*.sources")) if p.is_file()]
    for text in texts:  # deb822 stanzas
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, flags=re.MULTILINE))
            if (
                "deb" in fields.get("Types", "").split()
                and suite in fields.get("Suites", "").split()
            ):
                uri = fields.get("URIs", "").split()
                if uri and not uri[0].rstrip("/").endswith("-security"):
                    return uri[0]
    one_line = [Path("/etc/apt/sources.list"), *sorted(sources.glob("*.list"))]
    for path in one_line:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            match = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
            if match and match[2] == suite:
                return match[1]
    raise ProvisionError(f"no Debian mirror for {suite!r} in apt's sources")


def ensure_base_rootfs(cache_dir: Path | None = None) -> Path:
    """The stand-in base image's rootfs as a tarball, built by debootstrap unless cached."""
    cache = container_cache(cache_dir)
    tarball = cache / ROOTFS_NAME
    if tarball.is_file():
        _log("base rootfs: cached")
        return tarball
    if os.geteuid() != 0:
        raise CannotProvision("debootstrap needs root")
    ensure_host_tools()
    started = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=cache))
    log_path = cache / "debootstrap.log"
    try:
        rootfs = staging / "rootfs"
        cmd = [
            "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            SUITE, str(rootfs), apt_mirror(),
        ]  # fmt: skip
        _log(f"base rootfs: debootstrap {SUITE} (log: {log_path})")
        with log_path.open("w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise ProvisionError(f"debootstrap exited {code}:\n{tail}")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = staging / "rootfs.tar.gz"
        with partial.open("wb") as out:
            tar = subprocess.Popen(
                ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE
            )
            gzip = subprocess.run(["gzip", "-1"], stdin=tar.stdout, stdout=out, check=False)
            assert tar.stdout is not None
            tar.stdout.close()
            if tar.wait() != 0 or gzip.returncode != 0:
                raise ProvisionError("could not pack the base rootfs")
        partial.rename(tarball)  # last: an interrupted build is redone
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"base rootfs: built in {time.monotonic() - started:.1f} s ({tarball})")
    return tarball


def provision(cache_dir: Path | None = None) -> Path:
    """Docker and debootstrap installed, the base rootfs cached; returns the tarball."""
    cache = container_cache(cache_dir)
    with locked(cache):
        ensure_host_tools()
        return ensure_base_rootfs(cache_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $TRACE_PROXY_TEST_CACHE, else ~/.cache/trace-proxy-tests",
    )
    args = parser.parse_args(argv)
    try:
        provision(args.cache_dir)
    except CannotProvision as exc:
        _log(f"skipped: {exc} (the container tests will skip)")
        return 0
    except ProvisionError as exc:
        print(f"[provision:container] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
