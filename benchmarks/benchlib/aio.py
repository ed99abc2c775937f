"""Event loop choice shared by the benchmark's processes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, None]) -> None:
    """uvloop when installed (vLLM's uvicorn and trace-proxy use it), else plain asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def loop_name() -> str:
    """Which loop `run` uses, for the report."""
    try:
        from importlib.metadata import version

        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return f"uvloop {version('uvloop')}"
