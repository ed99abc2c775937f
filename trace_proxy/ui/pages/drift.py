"""A run's drifting calls (`/run/…/drift`): retokenization drift, each call with its first
differing token."""

from __future__ import annotations

import asyncio
import math
from functools import partial

from aiohttp import web

from trace_proxy.store.replicas import joined
from trace_proxy.ui import views
from trace_proxy.ui.site import RUN, Site, page_arg

DRIFT_PER_PAGE = 100  # trajectories whose records the drift list reads for one page


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/drift", partial(drift_page, site))


async def drift_page(site: Site, request: web.Request) -> web.Response:
    """The run's drifting calls (retokenization drift), each with its first differing
    token: trajectories in step order, a page of them at a time, each record read again."""
    await site.refreshed()
    with site.index.lock:
        run = site.run(request)
        entries = [
            entry
            for key in run.step_keys()
            for entry in sorted(run.steps[key].entries, key=lambda e: e.start)
            if entry.drift
        ]
        drifting = sum(entry.drift for entry in entries)
    pages = max(1, math.ceil(len(entries) / DRIFT_PER_PAGE))
    page = min(page_arg(request.query.get("page")), pages)
    shown = entries[(page - 1) * DRIFT_PER_PAGE : page * DRIFT_PER_PAGE]

    def read() -> list[views.DriftingCall]:
        found = []
        for entry in shown:
            try:
                records = site.read_parts(entry)
            except (OSError, ValueError):  # a line gone or changed since it was indexed
                continue
            found.extend(views.drifting_calls(entry, joined(records)))
        return found

    rows = await asyncio.to_thread(read)
    return site.render(
        "drift.html", run=run, rows=rows, trajectories=len(entries), calls=drifting,
        page=page, pages=pages,
    )  # fmt: skip
