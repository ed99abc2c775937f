"""Shared fixtures: the real Qwen tokenizer (loaded once) and the fake inference servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from fakes import FakeSGLang, FakeVLLM, StartFake

from trace_proxy.demo.tokenizer import load_qwen_tokenizer


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
