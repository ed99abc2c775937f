"""Upstreams registered over the admin port, and what a request may (not) do with them.

The proxy must never become an open relay: a request names a registered upstream by id (an
`X-Trace-Proxy-Upstream` value looked up in the set the token holder registered), and nothing
a request says reaches any other host.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.proxies import running_proxy, scripted_upstream, trajectories

from trace_proxy.config import ConfigError, Settings, resolve
from trace_proxy.proxy.upstreams import RegisteredUpstreams, RegistrationError, registered_url

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_registration_needs_a_token() -> None:
    with pytest.raises(ConfigError, match="--admin-token"):
        resolve("serve", {"register_upstreams": True})
    settings = resolve("serve", {"register_upstreams": True, "admin_token": TOKEN})
    assert settings.register_upstreams and settings.upstream == []


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com:8000",  # a name could resolve elsewhere later
        "http://10.0.0.1",  # no port
        "ftp://10.0.0.1:21",
        "http://user:pw@10.0.0.1:80",
        "http://10.0.0.1:80/?q=1",
        "http://10.0.0.1:99999",
        42,
    ],
)
def test_only_ip_literal_urls_register(url: object) -> None:
    with pytest.raises(RegistrationError):
        registered_url(url)


def test_registered_set_is_bounded_and_ids_are_checked() -> None:
    registered = RegisteredUpstreams(limit=2)
    registered.register("10.0.0.1:8000", "http://10.0.0.1:8000")
    registered.register("[::1]:8000", "http://[::1]:8000/")
    assert registered.listing() == {"10.0.0.1:8000": "http://10.0.0.1:8000",
                                    "[::1]:8000": "http://[::1]:8000"}  # fmt: skip
    with pytest.raises(RegistrationError, match="at most 2"):
        registered.register("third", "http://10.0.0.3:1")
    with pytest.raises(RegistrationError, match="not an upstream id"):
        registered.register("../admin", "http://10.0.0.3:1")
    assert registered.get("http://10.0.0.1:8000") is None  # a value is a name, not an address


def _settings(tmp_path: Path) -> dict[str, object]:
    return {"register_upstreams": True, "admin_token": TOKEN, "capture_mode": "inline",
            "export_mode": "inline"}  # fmt: skip


async def test_requests_reach_only_registered_upstreams(tmp_path: Path) -> None:
    seen: list[str] = []

    async def upstream(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-Trace-Proxy-Upstream", "(stripped)"))
        return web.json_response({"ok": True})

    async with (
        scripted_upstream(upstream) as upstream_url,
        running_proxy([], tmp_path, **_settings(tmp_path)) as (service, proxy_url),
        aiohttp.ClientSession() as http,
    ):
        admin = service.addresses.admin  # type: ignore[union-attr]
        server_id = upstream_url.removeprefix("http://")
        # Without the token, nothing can be registered.
        async with http.put(f"{admin}/upstreams/{server_id}", json={"url": upstream_url}) as r:
            assert r.status == 401
        # No registered upstream: a request naming one, or none, is refused and not forwarded.
        for headers in ({"X-Trace-Proxy-Upstream": server_id}, {}):
            async with http.post(f"{proxy_url}/v1/completions", json={}, headers=headers) as r:
                assert r.status == 421
                assert (await r.json())["error"]["type"] == "misdirected_request"
        async with http.put(
            f"{admin}/upstreams/{server_id}", json={"url": upstream_url}, headers=AUTH
        ) as r:
            assert r.status == 200
        async with http.get(f"{admin}/upstreams") as r:
            assert (await r.json())["registered"] == {server_id: upstream_url}
        # A URL or another host in the header is only an unknown name.
        for value in (upstream_url, "127.0.0.1:1", "169.254.169.254:80"):
            headers = {"X-Trace-Proxy-Upstream": value}
            async with http.post(f"{proxy_url}/v1/completions", json={}, headers=headers) as r:
                assert r.status == 421
        headers = {"X-Trace-Proxy-Upstream": server_id}
        async with http.post(f"{proxy_url}/v1/completions", json={}, headers=headers) as r:
            assert r.status == 200 and await r.json() == {"ok": True}
        assert seen == ["(stripped)"]  # forwarded once, without the proxy's own header
        async with http.delete(f"{admin}/upstreams/{server_id}", headers=AUTH) as r:
            assert r.status == 200
        async with http.post(f"{proxy_url}/v1/completions", json={}, headers=headers) as r:
            assert r.status == 421
    assert len(seen) == 1


async def test_fixed_upstreams_still_serve_requests_that_name_none(tmp_path: Path) -> None:
    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"fixed": True})

    async with (
        scripted_upstream(upstream) as upstream_url,
        running_proxy([upstream_url], tmp_path, **_settings(tmp_path)) as (_, proxy_url),
        aiohttp.ClientSession() as http,
        http.post(f"{proxy_url}/v1/completions", json={}) as r,
    ):
        assert await r.json() == {"fixed": True}


async def test_registration_is_refused_without_the_option(tmp_path: Path) -> None:
    async with (
        running_proxy(["http://127.0.0.1:9"], tmp_path, admin_token=TOKEN) as (service, _),
        aiohttp.ClientSession() as http,
    ):
        admin = service.addresses.admin  # type: ignore[union-attr]
        async with http.put(
            f"{admin}/upstreams/x", json={"url": "http://127.0.0.1:9"}, headers=AUTH
        ) as r:
            assert r.status == 403


async def test_done_closes_the_trajectory_with_its_reward(tmp_path: Path) -> None:
    """What the verl plugin sends when an agent-loop run ends: the trajectory is exported at
    once with the reward, before any idle timeout or step change."""

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                                               "token_ids": [1, 2]}]})  # fmt: skip

    headers = {"X-Rollout-Step": "3", "X-Rollout-Sample-Index": "1", "X-Rollout-N": "0",
               "X-Rollout-Trajectory-Id": "run-1", "X-Rollout-Project": "p"}  # fmt: skip
    settings = dataclasses.asdict(Settings())
    assert settings["idle_timeout"] >= 60  # closing is not left to idleness
    async with (
        scripted_upstream(upstream) as upstream_url,
        running_proxy([upstream_url], tmp_path, admin_token=TOKEN) as (service, proxy_url),
        aiohttp.ClientSession() as http,
    ):
        body = {"prompt": [5, 6], "max_tokens": 2}
        async with http.post(f"{proxy_url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
        admin = service.addresses.admin  # type: ignore[union-attr]
        close = {"trajectory_id": "run-1", "project": "p", "done": True, "reward": 0.5}
        async with http.post(f"{admin}/rewards", json=close, headers=AUTH) as r:
            assert (await r.json())["attached_to"] in ("open", "queued")
        await service.flush()
        [record] = trajectories(tmp_path)
        assert record["close_reason"] == "done"
        assert record["reward"] == 0.5
        # A done for a trajectory that is not open records nothing.
        again = {"trajectory_id": "run-1", "project": "p", "done": True}
        async with http.post(f"{admin}/rewards", json=again, headers=AUTH) as r:
            assert (await r.json())["attached_to"] == "unknown"
        await service.flush()
    assert len(trajectories(tmp_path)) == 1
