"""A step's GRPO groups side by side (`/run/…/step/NAME`): filtered, sorted, a page at a time,
each group with the prompt its sample asks."""

from __future__ import annotations

import asyncio
import math
from functools import partial
from urllib.parse import urlencode

from aiohttp import web

from trace_proxy.ui import views
from trace_proxy.ui.index import Entry
from trace_proxy.ui.site import RUN, Site, float_arg, page_arg, steps_asked
from trace_proxy.ui.urls import parse_step_name, run_url, step_name

GROUPS_PER_PAGE = 50
SORTS = {
    "sample": "sample",
    "reward": "mean reward, high first",
    "-reward": "mean reward, low first",
    "spread": "reward spread, widest first",
    "errors": "errors first",
}


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get(RUN + "/step/{step}", partial(step_page, site))


async def step_page(site: Site, request: web.Request) -> web.Response:
    await site.refreshed()
    key = parse_step_name(request.match_info["step"])
    query = request.query
    with site.index.lock:
        run = site.run(request)
        step = run.steps.get(key) if key is not None else None
        if key is None or step is None:
            raise web.HTTPNotFound(text="no such step in this run\n")
        entries = list(step.entries)
        summary = step.summary
        other = (not key[0], key[1])
        other_exists = other in run.steps
    split = query.get("split")
    if split in ("training", "validation") and (split == "validation") != key[0]:
        if not other_exists:
            raise web.HTTPNotFound(text=f"this step has no {split} trajectories\n")
        rest = [(k, v) for k, v in query.items() if k not in ("split", "page")]
        raise web.HTTPFound(
            f"{run_url(run)}/step/{step_name(other)}" + (f"?{urlencode(rest)}" if rest else "")
        )
    text = query.get("q", "").strip()
    matching = await asyncio.to_thread(site.index.search, entries, text) if text else None
    status = query.get("status", "")
    low, high = float_arg(query.get("min")), float_arg(query.get("max"))
    partial_only = query.get("partial", "")

    def keep(entry: Entry) -> bool:
        if matching is not None and entry.id not in matching:
            return False
        if status and entry.status != status:
            return False
        if partial_only in ("yes", "no") and entry.partial != (partial_only == "yes"):
            return False
        if low is not None and (entry.reward is None or entry.reward < low):
            return False
        return high is None or (entry.reward is not None and entry.reward <= high)

    groups = views.groups_of(entries)
    by_reward = query.get("order") == "reward"
    for group in groups:
        shown = [e for e in group.rollouts if keep(e)]
        if by_reward:
            shown.sort(key=lambda e: -math.inf if e.reward is None else -e.reward)
        group.shown = shown
    groups = [g for g in groups if g.shown]
    sort = query.get("sort", "sample")
    sort_groups(groups, sort)
    pages = max(1, math.ceil(len(groups) / GROUPS_PER_PAGE))
    page = min(page_arg(query.get("page")), pages)
    shown_groups = groups[(page - 1) * GROUPS_PER_PAGE : page * GROUPS_PER_PAGE]
    with site.index.lock:
        for group in shown_groups:
            group.prompt_steps = steps_asked(run, group.rollouts[0])
    await asyncio.to_thread(read_prompts, site, shown_groups)
    filters = {k: v for k, v in query.items() if k != "page" and v}
    return site.render(
        "step.html", run=run, key=key, summary=summary, groups=shown_groups,
        total_groups=len(groups), total=len(entries),
        shown=sum(len(g.shown) for g in groups), page=page, pages=pages,
        filters=filters, other=other if other_exists else None, query=query,
        widest=max((len(g.shown) for g in shown_groups), default=0), sorts=SORTS,
    )  # fmt: skip


def read_prompts(site: Site, groups: list[views.Group]) -> None:
    """Each shown group's prompt, from its first rollout's record: one line read per group
    of the page, never kept by the index."""
    for group in groups:
        try:
            group.prompt = views.sample_prompt(site.index.read_record(group.rollouts[0]))
        except (OSError, ValueError):  # a line gone or changed since it was indexed
            group.prompt = None


def sort_groups(groups: list[views.Group], sort: str) -> None:
    def mean(group: views.Group, missing: float) -> float:
        value = group.reward_mean
        return missing if value is None else value

    if sort == "reward":
        groups.sort(key=lambda g: -mean(g, -math.inf))
    elif sort == "-reward":
        groups.sort(key=lambda g: mean(g, math.inf))
    elif sort == "spread":
        groups.sort(key=lambda g: -g.reward_spread)
    elif sort == "errors":
        groups.sort(key=lambda g: -sum(e.status != "ok" for e in g.rollouts))
