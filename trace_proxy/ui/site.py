"""What every page of the viewer reads: the index, the search's text index, the templates, and
the lookups a page's URL asks for (its run, its trajectory). Each page family (`pages/`) attaches
its routes to the app with this; the app itself is put together in `server.py`."""

from __future__ import annotations

import asyncio
import math
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from trace_proxy.ui import formatting, views
from trace_proxy.ui.index import Entry, Run, StoreIndex
from trace_proxy.ui.textindex import TextIndex
from trace_proxy.ui.urls import ids_query, run_url, step_name, trajectory_url

RUN = "/run/{store:\\d+}/{project}/{experiment}"  # where a run's pages are


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("trace_proxy.ui", "templates"),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        marked=views.marked, num=formatting.num, when=formatting.when, secs=formatting.secs,
        step_name=step_name, message_text=views.message_text, json=formatting.json_text,
        quoted=formatting.quoted,
    )  # fmt: skip
    env.globals.update(
        run_url=run_url, trajectory_url=trajectory_url, urlencode=urlencode, ids_query=ids_query,
    )  # fmt: skip
    return env


class Site:
    """The viewer's state as its pages see it: the index, the templates, a token's text."""

    def __init__(
        self, index: StoreIndex, piece: views.Piece | None = None, text: TextIndex | None = None
    ) -> None:
        self.index = index
        if text is None:  # a temporary one, read from the stores again (`TextIndex.attach`)
            text = TextIndex()
            text.attach(index)
        self.text = text  # removed with the app (`on_cleanup`)
        self.piece = piece  # a token's text, for the logprobs strip
        self.env = environment()

    def read_parts(self, entry: Entry) -> list[dict[str, Any]]:
        """The stored records of `entry`: one, or one per replica that wrote a part of it."""
        return [self.index.read_record(part) for part in entry.parts]

    async def refreshed(self) -> int:
        return await asyncio.to_thread(self.index.refresh)

    def render(self, template: str, **context: Any) -> web.Response:
        page = self.env.get_template(template).render(
            generation=self.index.generation, stores=[str(s) for s in self.index.stores],
            **context,
        )  # fmt: skip
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    def run(self, request: web.Request) -> Run:
        info = request.match_info
        run = self.index.run((int(info["store"]), info["project"], info["experiment"]))
        if run is None:
            raise web.HTTPNotFound(text="no such run in the stores served\n")
        return run

    def entry(self, request: web.Request) -> tuple[Run, Entry]:
        """The run and the trajectory a page's URL names (404 when either is unknown)."""
        run = self.run(request)
        trajectory_id = request.match_info.get("id", request.query.get("id", ""))
        entry = run.by_id.get(trajectory_id)
        if entry is None:
            raise web.HTTPNotFound(text="no such trajectory in this run\n")
        return run, entry


def page_arg(value: str | None) -> int:
    """The page a `?page=` asks for, from 1 (not yet bounded by the pages there are)."""
    return max(1, int(float_arg(value) or 1))


def float_arg(value: str | None) -> float | None:
    if not value:
        return None
    try:
        result = float(value)
    except ValueError:
        return None
    return result if math.isfinite(result) else None


def steps_asked(run: Run, entry: Entry) -> int:
    """At how many steps (training and validation) `entry`'s prompt was kept."""
    if entry.prompt_hash is None:
        return 0
    return len({(e.validate, e.step) for e in run.by_prompt.get(entry.prompt_hash, ())})
