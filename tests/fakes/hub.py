"""A Hugging Face Hub that serves one local tokenizer directory, and answers file requests only
once a test releases them: a tokenizer that takes as long to load as the test wants.

`huggingface_hub` fetches `{HF_ENDPOINT}/{repo}/resolve/{revision}/{file}` (HEAD for the
metadata, GET for the bytes); the API routes (`/api/...`) are answered 404, which it treats as
"no such information" and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from .serving import serve_app


class FakeHub:
    def __init__(self, directory: Path, *, serves: bool = True) -> None:
        """`serves=False`: once released, every file is missing (a tokenizer that cannot be
        loaded)."""
        self.directory = directory
        self.serves = serves
        self.released = asyncio.Event()
        self.asked = asyncio.Event()  # a file was asked for: loading is under way
        self.requests: list[str] = []

    def release(self) -> None:
        self.released.set()

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        async with serve_app(app) as url:
            yield url

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        parts = request.path.split("/")
        if "resolve" not in parts or parts[1] == "api":
            return web.Response(status=404)
        self.asked.set()
        await self.released.wait()
        name = "/".join(parts[parts.index("resolve") + 2 :])
        path = self.directory / name
        if not self.serves or not path.is_file():
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        data = path.read_bytes()
        headers = {
            "X-Repo-Commit": "0" * 40,
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "Content-Length": str(len(data)),
        }
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=data, headers=headers)
