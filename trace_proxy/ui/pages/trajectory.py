"""A trajectory turn by turn, with its timeline, siblings and replays (`/run/…/t/ID`), and its
stored record as it is (`…/raw`)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from trace_proxy.store.replicas import joined
from trace_proxy.trajectories.prompts import transcript_of
from trace_proxy.ui import views
from trace_proxy.ui.index import Entry, Run
from trace_proxy.ui.plots import timeline
from trace_proxy.ui.site import RUN, Site, steps_asked

MAX_REPLAYS = 20  # replays of a trajectory linked from its page


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/t/{id}", partial(trajectory_page, site))
    app.router.add_get(RUN + "/t/{id}/raw", partial(raw_record, site))
    app.router.add_get(RUN + "/t", partial(by_query, site))  # ?id=, see urls.trajectory_url


async def trajectory_page(site: Site, request: web.Request) -> web.Response:
    await site.refreshed()
    with site.index.lock:
        run, entry = site.entry(request)
        siblings = sorted(
            (e for e in run.steps[(entry.validate, entry.step)].entries
             if e.group == entry.group),
            key=views.rollout_order,
        )  # fmt: skip
        prompt_steps = steps_asked(run, entry)
    record = joined(await asyncio.to_thread(site.read_parts, entry))
    view = views.trajectory_view(record, site.piece)
    with site.index.lock:
        recorded = recorded_of(site, run, record)
        replays = site.index.replays_of(run, entry)[:MAX_REPLAYS]
    return site.render(
        "trajectory.html", run=run, entry=entry, t=view, siblings=siblings,
        transcript=transcript_of(record), prompt_steps=prompt_steps, recorded=recorded,
        replays=replays,
        key=(entry.validate, entry.step), timeline=timeline(view),
    )  # fmt: skip


def recorded_of(site: Site, run: Run, record: dict[str, Any]) -> tuple[Run, Entry] | None:
    """The recorded trajectory a replayed one replays (`trace-proxy replay`'s labels name
    its record id, project and experiment), looked up among the runs the index found,
    in the replay's own store first; None when it is not served."""
    labels = record.get("labels")
    if not isinstance(labels, dict) or not isinstance(labels.get("replay_of"), str):
        return None
    names = (labels.get("replay_of_project"), labels.get("replay_of_experiment"))
    found = [r for r in site.index.runs.values() if (r.project, r.experiment) == names]
    for other in sorted(found, key=lambda r: (r.store != run.store, r.ref)):
        entry = other.by_id.get(labels["replay_of"])
        if entry is not None:
            return other, entry
    return None


async def by_query(site: Site, request: web.Request) -> web.Response:
    """A trajectory whose id cannot be a path segment: `?id=` (and `raw=1`)."""
    if request.query.get("raw"):
        return await raw_record(site, request)
    return await trajectory_page(site, request)


async def raw_record(site: Site, request: web.Request) -> web.Response:
    await site.refreshed()
    with site.index.lock:
        _, entry = site.entry(request)
    parts = await asyncio.to_thread(site.read_parts, entry)
    body = orjson.dumps(parts if len(parts) > 1 else parts[0], option=orjson.OPT_INDENT_2)
    return web.Response(body=body, content_type="application/json")
