"""Worker registration as sgl-model-gateway, SGLang's router, offers it.

slime registers its SGLang engines with the router (`/workers`, or the older `/add_worker`,
`/remove_worker` and `/list_workers`); the fake answers those calls the router's way and keeps
the list in `workers`, so a proxy between a trainer and its router can pass them through.
"""

from __future__ import annotations

from aiohttp import web

from trace_proxy.demo.simulated_vllm import json_response

from .base import SGLangBase


class GatewayRoutes(SGLangBase):
    """`/workers` (add, list, remove) and the older routes that do the same, the router's way."""

    async def _add_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url") or str((await self._json(request)).get("url", ""))
        if not url:
            return json_response({"error": "url is required"}, 400)
        if url not in self.workers:
            self.workers.append(url)
        return json_response({"status": "accepted", "url": url, "message": f"Added {url}"})

    async def _remove_worker(self, request: web.Request) -> web.Response:
        url = request.match_info.get("url") or request.query.get("url", "")
        if url in self.workers:
            self.workers.remove(url)
        return json_response({"status": "accepted", "url": url, "message": f"Removed {url}"})

    async def _list_workers(self, request: web.Request) -> web.Response:
        if request.path == "/list_workers":
            return json_response({"urls": list(self.workers)})
        workers = [{"url": url, "is_healthy": True} for url in self.workers]
        return json_response({"workers": workers, "total": len(workers)})
