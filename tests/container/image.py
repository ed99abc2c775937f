"""Building docker/Dockerfile as CI can: a local base image, wheels made on the host, no network.

The build context holds what `.dockerignore` lets through from the repository (read from that
file, so the two cannot disagree) and a `wheels/` directory: the package's dependencies and
setuptools, built by the host's pip. `docker build --network none` then installs from those
wheels only (`PIP_NO_INDEX`, `PIP_FIND_LINKS`, as the Dockerfile's header says).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .daemon import DockerDaemon, DockerError
from .provision import BASE_IMAGE

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
SETUPTOOLS = "setuptools>=68"  # pyproject.toml's build requirement


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
    wheels = dest / "wheels"
    project = f"{dest}[{extras}]" if extras else str(dest)
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels),
           SETUPTOOLS, project]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DockerError(f"pip wheel exited {done.returncode}:\n{done.stdout}{done.stderr}")
    for built in wheels.glob("trace_proxy-*.whl"):
        built.unlink()  # the image builds the package from its source, as a user's build does
    shutil.rmtree(dest / "build", ignore_errors=True)
    return dest


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
