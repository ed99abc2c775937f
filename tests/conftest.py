"""Shared fixtures: the real Qwen tokenizer (loaded once), the fake inference servers, and the
real servers of tests/real launched before the first test. The session's environment is cleared
of the machine's settings first (support/isolation.py). The container's and the real servers'
tests run first, the tests of each part of the package after them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import support.isolation as isolation  # first: before any library reads the environment
from aiohttp import web
from fakes import FakeSGLang, FakeVLLM, StartFake
from real.hostile import HOSTILE_RUN, is_hostile_test
from real.servers import REAL_TESTS_DIR, RealServers, real_servers
from real.verl_run import CLUSTER_RUN, FULLY_ASYNC_RUN, VERL_RUN, is_fully_async_test

from trace_proxy.demo.tokenizer import load_qwen_tokenizer

CONTAINER_TESTS_DIR = Path(__file__).resolve().parent / "container"
pytest_plugins = ["support.lane"]  # a second lane for the whole suite


def pytest_report_header() -> str:
    cleared = ", ".join(isolation.CLEARED) or "nothing"
    return f"environment: cleared of the machine's settings ({cleared}); loopback never proxied"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container's tests first (the real servers start beside them), then the real servers'
    tests, then every other: verl's run starts once no other test uses the real vLLM server
    (real/verl_run.py, whose ordering runs after this) and goes on beside the tests that follow.
    """

    def group(item: pytest.Item) -> int:
        parents = item.path.resolve().parents
        return 0 if CONTAINER_TESTS_DIR in parents else 1 if REAL_TESTS_DIR in parents else 2

    items.sort(key=group)  # stable: each group in collection order


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """The real Qwen2.5 tokenizer, built offline; loading takes seconds, so once per session."""
    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
async def fake_vllm(qwen_tokenizer: Any) -> AsyncIterator[tuple[FakeVLLM, str]]:
    """A deterministic simulated vLLM shared by tests that do not change its state."""
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    async with fake.serve() as url:
        yield fake, url


@pytest.fixture(scope="session")
async def fake_sglang(qwen_tokenizer: Any) -> AsyncIterator[tuple[FakeSGLang, str]]:
    """A deterministic fake SGLang shared by tests that do not change its state."""
    fake = FakeSGLang(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    async with fake.serve() as url:
        yield fake, url


@pytest.fixture
async def start_fake() -> AsyncIterator[StartFake]:
    """Start a test's own fake (for pause, weight versions, faults); stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(fake: FakeVLLM | FakeSGLang) -> str:
        runner, url = await fake.start()
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """trackio reads its directory once per process, when imported: one for the session."""
    return tmp_path_factory.mktemp("trackio")


@pytest.fixture(scope="session", autouse=True)
def _real_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealServers]:
    """The real servers the session's tests use (none when no real test runs), launched before
    the first test of the session whatever its directory, so that their start-up overlaps the
    tests before the first real one; stopped at session end."""

    def make_work_dir() -> Path:
        return tmp_path_factory.mktemp("real-servers")

    with real_servers(request.session.items, make_work_dir) as servers:
        CLUSTER_RUN.start_if_selected(request.session.items, tmp_path_factory.mktemp("cluster"))
        try:
            yield servers
        finally:
            HOSTILE_RUN.stop()
            VERL_RUN.stop()
            FULLY_ASYNC_RUN.stop()
            CLUSTER_RUN.stop()


_FULLY_ASYNC_SELECTED = pytest.StashKey[bool]()
_HOSTILE_SELECTED = pytest.StashKey[bool]()


def _fully_async_selected(request: pytest.FixtureRequest) -> bool:
    stash = request.session.stash
    if _FULLY_ASYNC_SELECTED not in stash:
        stash[_FULLY_ASYNC_SELECTED] = any(map(is_fully_async_test, request.session.items))
    return stash[_FULLY_ASYNC_SELECTED]


def _hostile_selected(request: pytest.FixtureRequest) -> bool:
    stash = request.session.stash
    if _HOSTILE_SELECTED not in stash:
        stash[_HOSTILE_SELECTED] = any(
            is_hostile_test(item) and item.get_closest_marker("skip") is None
            for item in request.session.items
        )
    return stash[_HOSTILE_SELECTED]


@pytest.fixture(autouse=True)
def _verl_in_the_background(
    request: pytest.FixtureRequest,
    _real_servers: RealServers,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """verl's run starts with the first test after the last other one that uses the real vLLM
    server (real/verl_run.py), and goes on beside the tests that follow; the fully async run
    starts with the first test after verl's run has exited, and the hostile environment's
    session (real/hostile.py) with the first test after both have: the server is theirs alone
    until then."""
    fully_async = _fully_async_selected(request)
    if VERL_RUN.exited and not FULLY_ASYNC_RUN.started and fully_async:
        try:
            vllm = _real_servers.wait_healthy("real_vllm")
            FULLY_ASYNC_RUN.start(vllm, tmp_path_factory.mktemp("verl-fully-async"))
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
            FULLY_ASYNC_RUN.could_not_start(repr(exc))
    verl_done = VERL_RUN.exited and (FULLY_ASYNC_RUN.exited or not fully_async)
    if verl_done and not HOSTILE_RUN.started and _hostile_selected(request):
        try:
            HOSTILE_RUN.start(_real_servers, tmp_path_factory.mktemp("hostile"))
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
            HOSTILE_RUN.could_not_start(repr(exc))  # its own test reports it
    if request.node is not VERL_RUN.start_with or VERL_RUN.started:
        return
    try:
        vllm = _real_servers.wait_healthy("real_vllm")
        VERL_RUN.start(vllm, tmp_path_factory.mktemp("verl"))
    except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
        VERL_RUN.could_not_start(repr(exc))  # this test is not verl's: verl's tests report it
