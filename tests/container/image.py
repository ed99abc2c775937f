"""Building docker/Dockerfile as CI can: a local base image, wheels made on the host, no network.

The build context holds what `.dockerignore` lets through from the repository (read from that
file, so the two cannot disagree) and a `wheels/` directory: the package's dependencies and
setuptools, built by the host's pip and kept in the test cache until pyproject.toml's
requirements change. `docker build --network none` then installs from those wheels only
(`PIP_NO_INDEX`, `PIP_FIND_LINKS`, as the Dockerfile's header says).
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .daemon import DockerDaemon, DockerError
from .provision import BASE_IMAGE, container_cache

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def admitted_paths(dockerignore: Path) -> list[str]:
    """The `!path` entries of a whitelist-style .dockerignore (wheels/ is made, not copied)."""
    entries = []
    for line in dockerignore.read_text().splitlines():
        line = line.strip()
        if line.startswith("!") and line.rstrip("/") != "!wheels":
            entries.append(line[1:].rstrip("/"))
    return entries


def make_context(dest: Path, extras: str = "") -> Path:
    """A build context like the repository's, plus host-built wheels; returns `dest`."""
    dest.mkdir(parents=True)
    shutil.copy2(REPO / ".dockerignore", dest / ".dockerignore")
    (dest / "docker").mkdir()
    shutil.copy2(DOCKERFILE, dest / "docker" / "Dockerfile")
    for entry in admitted_paths(REPO / ".dockerignore"):
        source, target = REPO / entry, dest / entry
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    shutil.copytree(dependency_wheels(extras), dest / "wheels")
    return dest


def dependency_wheels(extras: str = "") -> Path:
    """Wheels of the package's requirements (with `extras`) and setuptools, from the cache."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = {
        "build": project["build-system"]["requires"],
        "run": project["project"]["dependencies"],
        "extras": {
            e: project["project"]["optional-dependencies"][e] for e in extras.split(",") if e
        },
        "python": [sys.version_info[:2], platform.machine()],
    }
    digest = hashlib.sha256(json.dumps(requirements, sort_keys=True).encode()).hexdigest()
    cached = container_cache() / f"wheels-{digest[:16]}"
    if cached.is_dir():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".wheels-", dir=cached.parent))
    try:
        source = staging / "source"  # pip builds the package to resolve it: not in the repo
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, source / name)
        shutil.copytree(REPO / "trace_proxy", source / "trace_proxy",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        target = f"{source}[{extras}]" if extras else str(source)
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir",
               str(staging / "wheels"), *requirements["build"], target]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise DockerError(f"pip wheel exited {done.returncode}:\n{done.stdout}{done.stderr}")
        for built in (staging / "wheels").glob("trace_proxy-*.whl"):
            built.unlink()  # the image builds the package from its source, as a user's does
        (staging / "wheels").rename(cached)  # last: an interrupted run is redone
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def import_base(daemon: DockerDaemon, rootfs: Path) -> None:
    """The provisioned rootfs, under the name the Dockerfile's FROM uses."""
    daemon.run("import", "--change", "ENV LANG=C.UTF-8", str(rootfs), BASE_IMAGE)


def build(daemon: DockerDaemon, context: Path, tag: str, extras: str = "") -> None:
    daemon.run(
        "build", "--network", "none", "--file", str(context / "docker" / "Dockerfile"),
        "--build-arg", f"EXTRAS={extras}", "--build-arg", "PIP_NO_INDEX=1",
        "--build-arg", "PIP_FIND_LINKS=/src/wheels", "--tag", tag, str(context),
    )  # fmt: skip


def image_size(daemon: DockerDaemon, image: str) -> int:
    return int(daemon.run("image", "inspect", "--format", "{{.Size}}", image).stdout)
