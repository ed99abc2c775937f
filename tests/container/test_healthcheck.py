"""docker/healthcheck.py, the image's HEALTHCHECK, against a real proxy on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from aiohttp import web
from fakes import FakeVLLM
from support.proxies import closed_port, running_proxy, scripted_upstream

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("host", "url"),
    [
        (None, "http://127.0.0.1:8101/ready"),
        ("0.0.0.0", "http://127.0.0.1:8101/ready"),
        ("::", "http://127.0.0.1:8101/ready"),
        ("10.1.2.3", "http://10.1.2.3:8101/ready"),
        ("fd00::5", "http://[fd00::5]:8101/ready"),
    ],
)
def test_asks_the_admin_port_where_the_proxy_listens(host: str | None, url: str) -> None:
    environ = {} if host is None else {"TRACE_PROXY_HOST": host}
    assert load().ready_url(environ) == url


async def test_healthy_when_the_proxy_is_ready(
    tmp_path: Path, fake_vllm: tuple[FakeVLLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    healthcheck = load()
    monkeypatch.setenv("TRACE_PROXY_HOST", "127.0.0.1")
    monkeypatch.setenv("TRACE_PROXY_ADMIN_PORT", str(closed_port()))
    assert healthcheck.main() == 1  # nothing listening
    async with running_proxy([fake_vllm[1]], tmp_path) as (service, _):
        assert service.addresses is not None and service.addresses.admin is not None
        monkeypatch.setenv("TRACE_PROXY_ADMIN_PORT", service.addresses.admin.rsplit(":", 1)[1])
        assert await asyncio.to_thread(healthcheck.main) == 0  # blocking, as in its own process


async def test_unhealthy_while_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """What /ready answers while starting, and from SIGTERM on."""

    async def not_ready(request: web.Request) -> web.Response:
        body = {"status": "not ready", "checks": {"listening": "stopping"}}
        return web.json_response(body, status=503)

    async with scripted_upstream(not_ready) as url:
        monkeypatch.setenv("TRACE_PROXY_HOST", "127.0.0.1")
        monkeypatch.setenv("TRACE_PROXY_ADMIN_PORT", url.rsplit(":", 1)[1])
        assert await asyncio.to_thread(load().main) == 1
