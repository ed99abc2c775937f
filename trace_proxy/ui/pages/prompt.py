"""One prompt at every step where it was kept (`/run/…/prompt/HASH`): how the answers to it
changed across training."""

from __future__ import annotations

import asyncio
import math
from functools import partial

from aiohttp import web

from trace_proxy.ui import history, views
from trace_proxy.ui.plots import step_plots
from trace_proxy.ui.site import RUN, Site, page_arg

STEPS_PER_PAGE = 25  # of one prompt's history: two records read per step shown


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/prompt/{hash}", partial(prompt_page, site))


async def prompt_page(site: Site, request: web.Request) -> web.Response:
    """One prompt at every step where it was kept: how the answers to it changed."""
    await site.refreshed()
    digest = request.match_info["hash"]
    with site.index.lock:
        run = site.run(request)
        entries = list(run.by_prompt.get(digest, ()))
    if not entries:
        raise web.HTTPNotFound(text="no trajectory of this run was asked this prompt\n")
    steps = history.steps_of_prompt(entries)
    pages = max(1, math.ceil(len(steps) / STEPS_PER_PAGE))
    page = min(page_arg(request.query.get("page")), pages)
    shown = steps[(page - 1) * STEPS_PER_PAGE : page * STEPS_PER_PAGE]

    def read() -> str | None:
        history.read_answers(shown, site.index.read_record, site.piece)
        try:
            return views.sample_prompt(site.index.read_record(steps[0].rollouts[0]))
        except (OSError, ValueError):
            return None

    prompt = await asyncio.to_thread(read)
    training = [s.row for s in steps if not s.key[0] and s.key[1] is not None]
    return site.render(
        "prompt.html", run=run, digest=digest, steps=shown, prompt=prompt,
        total_steps=len(steps), rollouts=len(entries), plots=step_plots(training),
        page=page, pages=pages,
    )  # fmt: skip
