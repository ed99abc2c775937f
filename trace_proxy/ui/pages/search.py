"""A run searched across its steps (`/run/…/search`): the query and its results as
`ui/search.py` finds them."""

from __future__ import annotations

import asyncio
from functools import partial

from aiohttp import web

from trace_proxy.ui import search
from trace_proxy.ui.index import Run
from trace_proxy.ui.site import RUN, Site


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/search", partial(search_page, site))


async def search_page(site: Site, request: web.Request) -> web.Response:
    """Trajectories of every step of the run, by text and filters (`search.py`)."""
    await site.refreshed()
    query = search.Query.of(request.query)

    def find() -> tuple[Run, search.Results | None]:
        with site.index.lock:
            run = site.run(request)
            if query.problems or not query.asked:
                return run, None
            return run, search.search(site.text, run, query)

    run, results = await asyncio.to_thread(find)
    status = 400 if query.problems or (results is not None and results.error) else 200
    response = site.render(
        "search.html", run=run, query=query, params=request.query, results=results,
        filters={k: v for k, v in request.query.items() if k != "page" and v},
    )  # fmt: skip
    response.set_status(status)
    return response
