"""Every port as strict as the proxy port: the admin port and the viewer under over-long heads,
log lines a client cannot forge, registered URLs checked whole, methods the proxy does not
forward answered by it.

Each test plays what a hostile or careless client sends, over a raw socket where a client
library would refuse to send it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.proxies import closed_port, metric, running_proxy, scripted_upstream

from trace_proxy.config import ConfigError, Settings, resolve
from trace_proxy.logtext import configure_logging
from trace_proxy.proxy.upstreams import RegistrationError, registered_url
from trace_proxy.ui import server as ui_server

GUARD = 20.0  # seconds: a failure bound, not a synchronisation
FAST = {"capture_mode": "inline", "export_mode": "inline"}
TOKEN = "s3cret-token"
SECRET = "SECRETSECRET"  # what a credential in an over-long header holds


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    return host, int(port)


async def exchange(url: str, request: bytes) -> bytes:
    """Send `request` as it is; everything answered until the server closes (within GUARD)."""
    reader, writer = await asyncio.open_connection(*host_port(url))
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.read(), GUARD)
    finally:
        writer.close()


def over_long_heads(limit: int) -> list[bytes]:
    """What the issue saw: an over-long request line, Authorization and Cookie header."""
    long = SECRET * (limit // len(SECRET) + 2)
    return [
        b"PUT /upstreams/%s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" % long.encode(),
        b"POST /rewards HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: 2\r\n\r\n{}" % long.encode(),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nCookie: session=%s\r\n\r\n" % long.encode(),
    ]


def assert_refused_quietly(answers: list[bytes], caplog: pytest.LogCaptureFixture) -> None:
    for answer in answers:
        assert answer[:13] in (b"HTTP/1.1 431 ", b"HTTP/1.0 431 "), answer[:80]
        assert SECRET.encode() not in answer
    assert "Traceback" not in caplog.text
    assert SECRET not in caplog.text
    assert not any(r.exc_info for r in caplog.records)
    logged = [r for r in caplog.records if "--max-header-size" in r.getMessage()]
    assert len(logged) == 1  # once per reason, not once per request


async def test_the_admin_port_answers_over_long_heads_431_and_logs_no_credential(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    limits = {"max_header_size": 2048}
    async with (
        scripted_upstream(ok) as up,
        running_proxy(
            [up], tmp_path, admin_token=TOKEN, register_upstreams=True, **limits, **FAST
        ) as (service, _),  # fmt: skip
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        answers = [await exchange(admin, head) for head in over_long_heads(2048) * 2]
        assert metric(service.metrics, "trace_proxy_admin_rejected_total",
                      reason="header_too_large") == 6  # fmt: skip
        assert metric(service.metrics, "trace_proxy_client_rejected_total",
                      reason="header_too_large") == 0  # fmt: skip
        async with aiohttp.ClientSession() as session:  # the port still serves what is valid
            async with session.get(admin + "/health") as resp:
                assert resp.status == 200
            async with session.put(admin + "/upstreams/a", json={"url": up}) as resp:
                assert resp.status == 401  # and still wants its token
    assert_refused_quietly(answers, caplog)
    assert any("the admin port" in r.getMessage() for r in caplog.records)


async def test_the_admin_port_answers_broken_http_400_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with (
        scripted_upstream(ok) as up,
        running_proxy([up], tmp_path, admin_token=TOKEN, **FAST) as (service, _),
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        answer = await exchange(
            service.addresses.admin,
            b"POST /rewards HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: nope\r\n\r\n" % SECRET.encode(),
        )
        assert answer[:13] in (b"HTTP/1.1 400 ", b"HTTP/1.0 400 "), answer[:80]
        assert metric(service.metrics, "trace_proxy_admin_rejected_total",
                      reason="bad_request") == 1  # fmt: skip
    assert "Traceback" not in caplog.text and SECRET not in caplog.text


async def test_the_viewer_answers_over_long_heads_431_and_logs_no_credential(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    runner, url, _ = await ui_server.start([tmp_path], port=0)
    try:
        limit = Settings().max_header_size
        answers = [await exchange(url, head) for head in over_long_heads(limit)]
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 200  # the runs page still opens
    finally:
        await runner.cleanup()
    assert_refused_quietly(answers, caplog)
    assert any("the viewer" in r.getMessage() for r in caplog.records)


async def test_a_client_cannot_write_a_log_line(tmp_path: Path) -> None:
    """A path holding an encoded line feed, to an upstream that is down: the warning the
    proxy logs stays one line, the client's text escaped, as the command line logs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    down = f"http://127.0.0.1:{closed_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trace_proxy", "serve", "--upstream", down, "--port", "0",
         "--admin-port", "0", "--output", str(tmp_path), "--capture-mode", "inline",
         "--export-mode", "inline", "--log-level", "INFO"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        proxy = await asyncio.wait_for(asyncio.to_thread(_listening_url, proc), 60)
        forged = "/v1/completions%0a2026-01-01 00:00:00,000 CRITICAL forged: FORGED%0d%00"
        async with aiohttp.ClientSession() as session:
            async with session.post(proxy + forged, json={"prompt": "x"}) as resp:
                assert resp.status == 502
    finally:
        proc.terminate()
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    lines = err.splitlines()
    assert not any(line.startswith(("2026-01-01", "FORGED")) for line in lines)
    [warning] = [line for line in lines if "FORGED" in line]
    assert "/v1/completions\\n2026-01-01" in warning and "FORGED\\r\\x00" in warning


def _listening_url(proc: subprocess.Popen[str]) -> str:
    """The proxy's URL, from the line `serve` prints once it listens."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("trace-proxy: forwarding "):
            return line.split()[2]
    raise AssertionError(f"the proxy did not start (exit code {proc.wait()})")


def test_log_messages_are_one_printable_line(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers = root.handlers[:]
    root.handlers = []
    try:
        configure_logging("%(levelname)s %(message)s")
        logging.getLogger("trace_proxy.x").warning("path %s", "/a\nCRITICAL b\x1b[2J\u202e")
        logging.getLogger("aiohttp.x").warning("said\r\nforged")
    finally:
        for handler in root.handlers:
            root.removeHandler(handler)
        root.handlers = handlers
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "WARNING path /a\\nCRITICAL b\\x1b[2J\\u202e",
        "WARNING said\\r\\nforged",
    ]


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/a\r\nX-Injected: 1",
        "http://127.0.0.1:8000/a\nb",
        "http://127.0.0.1:8000/a b",
        "http://127.0.0.1:8000/a\x00b",
        "http://127.0.0.1:8000/a\tb",
        "http://127.0.0.1:8000/é",
        "http://127.0.0.1:8000/a\\b",
        'http://127.0.0.1:8000/a"b',
        "http://127.0.0.1:80\r\n00",
    ],
)
def test_upstream_urls_are_plain_whole(url: str) -> None:
    with pytest.raises(RegistrationError):
        registered_url(url)
    with pytest.raises(ConfigError, match="--upstream"):
        resolve("serve", {"upstream": [url]})


def test_plain_paths_still_register() -> None:
    for url in (
        "http://127.0.0.1:8000/v1",
        "http://[::1]:8000/a/b-c_d.e~f%20g/",
        "http://10.0.0.1:1",
    ):
        assert registered_url(url) == url.rstrip("/")
        assert resolve("serve", {"upstream": [url]}).upstream == [url.rstrip("/")]


async def test_a_registered_url_with_a_line_break_never_reaches_the_upstream_or_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []

    async def upstream(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"choices": []})

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([], tmp_path, admin_token=TOKEN, register_upstreams=True, **FAST) as (
            service,
            proxy,
        ),  # fmt: skip
        aiohttp.ClientSession() as session,
    ):
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with session.put(admin + "/upstreams/a", headers=auth,
                               json={"url": up + "/aX\r\nX-Injected: 1"}) as resp:  # fmt: skip
            assert resp.status == 400
            assert "printable ASCII" in (await resp.json())["error"]
        async with session.post(proxy + "/v1/completions", json={"prompt": "x"},
                                headers={"X-Trace-Proxy-Upstream": "a"}) as resp:  # fmt: skip
            assert resp.status == 421  # nothing was registered
        async with session.put(admin + "/upstreams/a", headers=auth, json={"url": up}) as resp:
            assert resp.status == 200
        async with session.post(proxy + "/v1/completions", json={"prompt": "x"},
                                headers={"X-Trace-Proxy-Upstream": "a"}) as resp:  # fmt: skip
            assert resp.status == 200
    assert seen == ["/v1/completions"]
    assert "X-Injected" not in caplog.text


async def test_connect_and_asterisk_targets_are_answered_not_forwarded(tmp_path: Path) -> None:
    seen: list[str] = []

    async def upstream(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.raw_path}")
        return web.Response(text="ok")

    async with (
        scripted_upstream(upstream) as up,
        running_proxy([up], tmp_path, **FAST) as (service, proxy),
    ):
        connect = await exchange(
            proxy,
            b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\nConnection: close\r\n\r\n",
        )
        head = connect.partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 405 ")
        assert b"\r\nAllow: GET, HEAD, POST" in head
        asterisk = await exchange(
            proxy, b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert asterisk.startswith(b"HTTP/1.1 400 ")
        plain = await exchange(
            proxy, b"OPTIONS /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert plain.startswith(b"HTTP/1.1 200 ")
        assert (
            metric(service.metrics, "trace_proxy_requests_total", kind="other", status="4xx") == 2
        )
    assert seen == ["OPTIONS /v1/models"]
