"""Faithful fake inference servers for the tests (vLLM 0.33 and SGLang 0.5.23 wire formats)."""

from collections.abc import Awaitable, Callable

from .sglang import FakeSGLang
from .vllm import FakeVLLM

StartFake = Callable[[FakeVLLM | FakeSGLang], Awaitable[str]]
"""The `start_fake` fixture: serve a test's own fake until the test ends; returns its URL."""

__all__ = ["FakeSGLang", "FakeVLLM", "StartFake"]
