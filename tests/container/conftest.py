"""Session fixtures: a Docker daemon of the run's own, and the image built from docker/Dockerfile.

Provisioning (Docker and debootstrap from apt, the base image's rootfs) runs once into the test
cache; `python tests/container/provision.py` does it ahead of time, as CI does. The tests skip,
saying why, only where Docker cannot run at all (not root, no apt); any other failure fails.
`TRACE_PROXY_SKIP_CONTAINER=1` skips the tests that need Docker for a quick local run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .daemon import DockerDaemon, running_daemon
from .image import build, import_base, make_context
from .provision import CannotProvision, provision

SKIP_ENV = "TRACE_PROXY_SKIP_CONTAINER"
IMAGE = "trace-proxy:test"


@pytest.fixture(scope="session")
def docker_daemon() -> Iterator[DockerDaemon]:
    """A running daemon with the base image imported; stopped and removed after the session."""
    if os.environ.get(SKIP_ENV, "").lower() in ("1", "true", "yes"):
        pytest.skip(f"{SKIP_ENV} is set")
    try:
        rootfs = provision()
    except CannotProvision as exc:
        pytest.skip(f"Docker cannot run here: {exc}")
    with running_daemon() as daemon:
        import_base(daemon, rootfs)
        yield daemon
    left = daemon.leftovers()
    assert not left, f"the Docker daemon left behind: {left}"


@pytest.fixture(scope="session")
def image(docker_daemon: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> str:
    """docker/Dockerfile built with no extras, offline, from host-built wheels."""
    context = make_context(tmp_path_factory.mktemp("image") / "context")
    build(docker_daemon, context, IMAGE)
    return IMAGE


@pytest.fixture
def free_volume(docker_daemon: DockerDaemon, request: pytest.FixtureRequest) -> Iterator[str]:
    """A named volume for one test, removed after it."""
    name = f"trace-proxy-{request.node.name}".replace("[", "-").replace("]", "")[:60]
    docker_daemon.run("volume", "create", name)
    yield name
    docker_daemon.run("volume", "rm", "--force", name, check=False)
