"""Server-sent events as Starlette writes them, with keep-alives and injected errors.

Both servers stream `data:` events ended by `[DONE]`; the knobs that test a proxy's stream
handling (keep-alive comments, a mid-stream error event) live here, once for every route.
"""

from __future__ import annotations

from aiohttp import web

EVENT_STREAM = "text/event-stream; charset=utf-8"  # what Starlette sends for SSE
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class SSEStream:
    """A `text/event-stream` response with keep-alive comments and error injection."""

    def __init__(
        self,
        request: web.Request,
        *,
        keepalive: bool,
        error_after: int | None,
        error_event: bytes,
    ) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
        self._keepalive = keepalive
        self._error_after = error_after
        self._error_event = error_event
        self.sent = 0
        self.failed = False

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: bytes) -> bool:
        """Write one `data:` event; False when the injected error ended the stream instead."""
        if self._error_after is not None and self.sent >= self._error_after:
            await self.response.write(b"data: " + self._error_event + b"\n\n" + DONE)
            self.failed = True
            return False
        if self._keepalive and self.sent:
            await self.response.write(KEEPALIVE)
        await self.response.write(b"data: " + payload + b"\n\n")
        self.sent += 1
        return True

    async def finish(self, tail: bytes = DONE) -> web.StreamResponse:
        if not self.failed:
            await self.response.write(tail)
        await self.response.write_eof()
        return self.response


async def error_stream(request: web.Request, event: bytes) -> web.StreamResponse:
    """A stream whose only event is `event` (a request refused after streaming was asked for)."""
    sse = SSEStream(request, keepalive=False, error_after=0, error_event=event)
    await sse.open()
    await sse.send(b"")
    return await sse.finish()
