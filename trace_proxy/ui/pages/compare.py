"""Trajectories side by side (`/run/…/compare`): sibling rollouts of one run, or a replayed
trajectory beside the recorded one it replays, the first divergence marked."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

from aiohttp import web

from trace_proxy.ui import views
from trace_proxy.ui.index import Entry, Run
from trace_proxy.ui.pages.trajectory import recorded_of
from trace_proxy.ui.site import RUN, Site

MAX_COMPARED = 8


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/compare", partial(compare_page, site))


async def compare_page(site: Site, request: web.Request) -> web.Response:
    """Rollouts of one run side by side (`?id=…&id=…`), or a replayed trajectory beside the
    recorded one it replays (`?id=…&recorded=1`), the first divergence marked."""
    await site.refreshed()
    ids = request.query.getall("id", [])
    with site.index.lock:
        run = site.run(request)
        entries = [run.by_id[i] for i in dict.fromkeys(ids) if i in run.by_id]
    if request.query.get("recorded"):
        return await compare_recorded(site, run, entries)
    if len(entries) < 2:
        raise web.HTTPBadRequest(text="name two or more trajectories of this run: ?id=…&id=…\n")
    entries = entries[:MAX_COMPARED]
    return await compare(site, [(run, e, None) for e in entries], run)


async def compare_recorded(site: Site, run: Run, entries: list[Entry]) -> web.Response:
    if len(entries) != 1:
        raise web.HTTPBadRequest(text="name one replayed trajectory of this run: ?id=…\n")
    record = await asyncio.to_thread(site.index.read_record, entries[0])
    with site.index.lock:
        recorded = recorded_of(site, run, record)
    if recorded is None:
        raise web.HTTPNotFound(text="this is no replay of a trajectory the viewer serves\n")
    columns = [(*recorded, "recorded"), (run, entries[0], "replayed")]
    return await compare(site, columns, run)


async def compare(
    site: Site, columns: Sequence[tuple[Run, Entry, str | None]], run: Run
) -> web.Response:
    """Each column's trajectory (its run, its entry, what it is) turn by turn."""
    entries = [entry for _, entry, _ in columns]
    records = await asyncio.to_thread(lambda: [site.index.read_record(e) for e in entries])
    trajectories = [views.trajectory_view(r, site.piece) for r in records]
    divergence = views.first_divergence(trajectories)
    rows = max(len(t.turns) for t in trajectories)
    return site.render(
        "compare.html", run=run, columns=columns, trajectories=trajectories,
        divergence=divergence, rows=rows, split_at=views.split_at,
        key=(entries[-1].validate, entries[-1].step),
    )  # fmt: skip
