"""`trace-proxy ui`: the rollout viewer, an aiohttp app over `StoreIndex`.

Pages are rendered on the server by Jinja2 with autoescaping on: every string a record holds
came from a model or a client, so it reaches the page only escaped. The Content-Security-Policy
allows only the viewer's own script and style, so even markup that slipped through could not
run. Requests whose Host is not the address served are refused while it listens on loopback,
so a web page cannot read the store through a rebound DNS name.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
import orjson
from aiohttp import web

from trace_proxy.config import Settings
from trace_proxy.exporters.leftovers import leftovers, notice
from trace_proxy.logtext import printable
from trace_proxy.proxy.limits import ClientLimits, LimitedAppRunner, Rejections
from trace_proxy.store.replicas import joined
from trace_proxy.trajectories.prompts import transcript_of
from trace_proxy.ui import history, search, views
from trace_proxy.ui.index import Entry, Run, StepKey, StoreIndex
from trace_proxy.ui.textindex import SearchUnavailable, TextIndex

GROUPS_PER_PAGE = 50
STEPS_PER_PAGE = 25  # of one prompt's history: two records read per step shown
DASH = "\u2013"  # shown for a missing value
MAX_COMPARED = 8
MAX_REPLAYS = 20  # replays of a trajectory linked from its page
DRIFT_PER_PAGE = 100  # trajectories whose records the drift list reads for one page
STATIC = {  # every file the viewer serves besides its pages: fixed names, no path from a URL
    "viewer.css": "text/css",
    "viewer.js": "text/javascript",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
SORTS = {
    "sample": "sample",
    "reward": "mean reward, high first",
    "-reward": "mean reward, low first",
    "spread": "reward spread, widest first",
    "errors": "errors first",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def run_url(run: Run) -> str:
    project, experiment = quote(run.project_dir, safe=""), quote(run.experiment_dir, safe="")
    return f"/run/{run.store}/{project}/{experiment}"


def trajectory_url(run: Run, trajectory_id: str, raw: bool = False) -> str:
    """A trajectory's page (or its raw record): its id is one path segment, whatever it holds
    (`/`, `?`, `#`), or the query where a segment cannot hold it (`.` and `..`, which every
    URL parser removes)."""
    if trajectory_id in (".", ".."):
        query = {"id": trajectory_id, **({"raw": "1"} if raw else {})}
        return f"{run_url(run)}/t?{urlencode(query)}"
    return f"{run_url(run)}/t/{quote(trajectory_id, safe='')}{'/raw' if raw else ''}"


def ids_query(entries: Sequence[Entry]) -> str:
    return urlencode([("id", e.id) for e in entries])


def step_name(key: StepKey) -> str:
    validate, step = key
    return f"{'validate-' if validate else ''}{'none' if step is None else step}"


def parse_step_name(name: str) -> StepKey | None:
    validate = name.startswith("validate-")
    rest = name.removeprefix("validate-")
    if rest == "none":
        return (validate, None)
    if rest.isdigit() or (rest.startswith("-") and rest[1:].isdigit()):
        return (validate, int(rest))
    return None


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("trace_proxy.ui", "templates"),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        marked=views.marked, num=_num, when=_when, secs=_secs, step_name=step_name,
        message_text=views.message_text, json=_json_text, quoted=_quoted,
    )  # fmt: skip
    env.globals.update(
        run_url=run_url, trajectory_url=trajectory_url, urlencode=urlencode, sorts=SORTS,
        ids_query=ids_query,
    )  # fmt: skip
    return env


class Viewer:
    """The app's state: the index, the templates, the address served."""

    def __init__(
        self, index: StoreIndex, piece: views.Piece | None = None, text: TextIndex | None = None
    ) -> None:
        self.index = index
        if text is None:  # a temporary one, read from the stores again (`TextIndex.attach`)
            text = TextIndex()
            text.attach(index)
        self.text = text  # removed with the app (`on_cleanup`)
        self.piece = piece  # a token's text, for the logprobs strip
        self.env = _environment()
        self.allowed_hosts: set[str] | None = None  # set once listening on loopback

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self.runs_page)
        app.router.add_get("/api/generation", self.generation)
        app.router.add_get("/static/{name}", self.static)
        base = "/run/{store:\\d+}/{project}/{experiment}"
        app.router.add_get(base + "/", self.run_page)
        app.router.add_get(base + "/step/{step}", self.step_page)
        app.router.add_get(base + "/t/{id}", self.trajectory_page)
        app.router.add_get(base + "/t/{id}/raw", self.raw_record)
        app.router.add_get(base + "/t", self.by_query)  # ?id=, see trajectory_url
        app.router.add_get(base + "/compare", self.compare_page)
        app.router.add_get(base + "/prompt/{hash}", self.prompt_page)
        app.router.add_get(base + "/drift", self.drift_page)
        app.router.add_get(base + "/search", self.search_page)
        app.on_cleanup.append(self._close_text)
        return app

    async def _close_text(self, app: web.Application) -> None:
        await asyncio.to_thread(self.text.close)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.allowed_hosts is not None and request.host.lower() not in self.allowed_hosts:
            return web.Response(status=421, text="this viewer answers only on its own address\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="read only\n")
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(SECURITY_HEADERS)
            raise
        response.headers.update(SECURITY_HEADERS)
        return response

    def _read_parts(self, entry: Entry) -> list[dict[str, Any]]:
        """The stored records of `entry`: one, or one per replica that wrote a part of it."""
        return [self.index.read_record(part) for part in entry.parts]

    async def _refreshed(self) -> int:
        return await asyncio.to_thread(self.index.refresh)

    def _render(self, template: str, **context: Any) -> web.Response:
        page = self.env.get_template(template).render(
            generation=self.index.generation, stores=[str(s) for s in self.index.stores],
            **context,
        )  # fmt: skip
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    def _run(self, request: web.Request) -> Run:
        info = request.match_info
        run = self.index.run((int(info["store"]), info["project"], info["experiment"]))
        if run is None:
            raise web.HTTPNotFound(text="no such run in the stores served\n")
        return run

    def _entry(self, request: web.Request) -> tuple[Run, Entry]:
        """The run and the trajectory a page's URL names (404 when either is unknown)."""
        run = self._run(request)
        trajectory_id = request.match_info.get("id", request.query.get("id", ""))
        entry = run.by_id.get(trajectory_id)
        if entry is None:
            raise web.HTTPNotFound(text="no such trajectory in this run\n")
        return run, entry

    # --- pages -------------------------------------------------------------------------------

    async def runs_page(self, request: web.Request) -> web.Response:
        await self._refreshed()
        with self.index.lock:
            runs = sorted(self.index.runs.values(), key=lambda r: r.ref)
            rows = [_run_row(run) for run in runs]
        return self._render("runs.html", rows=rows)

    async def run_page(self, request: web.Request) -> web.Response:
        await self._refreshed()
        with self.index.lock:
            run = self._run(request)
            rows = [_step_row(key, run.steps[key]) for key in run.step_keys()]
            train = [r for r in rows if not r["validate"]]
            validation = [r for r in rows if r["validate"]]
            row = _run_row(run)
            training = [e for key in run.step_keys() if not key[0]
                        for e in run.steps[key].entries]  # fmt: skip
            version_plots = _version_plots(training)
        return self._render(
            "run.html", run=run, row=row, train=train, validation=validation,
            plots=_plots(train), validation_plots=_plots(validation),
            version_plots=version_plots,
        )  # fmt: skip

    async def step_page(self, request: web.Request) -> web.Response:
        await self._refreshed()
        key = parse_step_name(request.match_info["step"])
        query = request.query
        with self.index.lock:
            run = self._run(request)
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
        matching = await asyncio.to_thread(self.index.search, entries, text) if text else None
        status = query.get("status", "")
        low, high = _float_arg(query.get("min")), _float_arg(query.get("max"))
        partial = query.get("partial", "")

        def keep(entry: Entry) -> bool:
            if matching is not None and entry.id not in matching:
                return False
            if status and entry.status != status:
                return False
            if partial in ("yes", "no") and entry.partial != (partial == "yes"):
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
        _sort_groups(groups, sort)
        page = max(1, int(_float_arg(query.get("page")) or 1))
        pages = max(1, math.ceil(len(groups) / GROUPS_PER_PAGE))
        page = min(page, pages)
        shown_groups = groups[(page - 1) * GROUPS_PER_PAGE : page * GROUPS_PER_PAGE]
        with self.index.lock:
            for group in shown_groups:
                group.prompt_steps = _steps_asked(run, group.rollouts[0])
        await asyncio.to_thread(self._read_prompts, shown_groups)
        filters = {k: v for k, v in query.items() if k != "page" and v}
        return self._render(
            "step.html", run=run, key=key, summary=summary, groups=shown_groups,
            total_groups=len(groups), total=len(entries),
            shown=sum(len(g.shown) for g in groups), page=page, pages=pages,
            filters=filters, other=other if other_exists else None, query=query,
            widest=max((len(g.shown) for g in shown_groups), default=0),
        )  # fmt: skip

    def _read_prompts(self, groups: list[views.Group]) -> None:
        """Each shown group's prompt, from its first rollout's record: one line read per group
        of the page, never kept by the index."""
        for group in groups:
            try:
                group.prompt = views.sample_prompt(self.index.read_record(group.rollouts[0]))
            except (OSError, ValueError):  # a line gone or changed since it was indexed
                group.prompt = None

    async def trajectory_page(self, request: web.Request) -> web.Response:
        await self._refreshed()
        with self.index.lock:
            run, entry = self._entry(request)
            siblings = sorted(
                (e for e in run.steps[(entry.validate, entry.step)].entries
                 if e.group == entry.group),
                key=views.rollout_order,
            )  # fmt: skip
            prompt_steps = _steps_asked(run, entry)
        record = joined(await asyncio.to_thread(self._read_parts, entry))
        view = views.trajectory_view(record, self.piece)
        with self.index.lock:
            recorded = self._recorded_of(run, record)
            replays = self.index.replays_of(run, entry)[:MAX_REPLAYS]
        return self._render(
            "trajectory.html", run=run, entry=entry, t=view, siblings=siblings,
            transcript=transcript_of(record), prompt_steps=prompt_steps, recorded=recorded,
            replays=replays,
            key=(entry.validate, entry.step), timeline=_timeline(view),
        )  # fmt: skip

    def _recorded_of(self, run: Run, record: dict[str, Any]) -> tuple[Run, Entry] | None:
        """The recorded trajectory a replayed one replays (`trace-proxy replay`'s labels name
        its record id, project and experiment), looked up among the runs the index found,
        in the replay's own store first; None when it is not served."""
        labels = record.get("labels")
        if not isinstance(labels, dict) or not isinstance(labels.get("replay_of"), str):
            return None
        names = (labels.get("replay_of_project"), labels.get("replay_of_experiment"))
        found = [r for r in self.index.runs.values() if (r.project, r.experiment) == names]
        for other in sorted(found, key=lambda r: (r.store != run.store, r.ref)):
            entry = other.by_id.get(labels["replay_of"])
            if entry is not None:
                return other, entry
        return None

    async def by_query(self, request: web.Request) -> web.Response:
        """A trajectory whose id cannot be a path segment: `?id=` (and `raw=1`)."""
        if request.query.get("raw"):
            return await self.raw_record(request)
        return await self.trajectory_page(request)

    async def raw_record(self, request: web.Request) -> web.Response:
        await self._refreshed()
        with self.index.lock:
            _, entry = self._entry(request)
        parts = await asyncio.to_thread(self._read_parts, entry)
        body = orjson.dumps(parts if len(parts) > 1 else parts[0], option=orjson.OPT_INDENT_2)
        return web.Response(body=body, content_type="application/json")

    async def compare_page(self, request: web.Request) -> web.Response:
        """Rollouts of one run side by side (`?id=…&id=…`), or a replayed trajectory beside the
        recorded one it replays (`?id=…&recorded=1`), the first divergence marked."""
        await self._refreshed()
        ids = request.query.getall("id", [])
        with self.index.lock:
            run = self._run(request)
            entries = [run.by_id[i] for i in dict.fromkeys(ids) if i in run.by_id]
        if request.query.get("recorded"):
            return await self._compare_recorded(run, entries)
        if len(entries) < 2:
            raise web.HTTPBadRequest(text="name two or more trajectories of this run: ?id=…&id=…\n")
        entries = entries[:MAX_COMPARED]
        return await self._compare([(run, e, None) for e in entries], run)

    async def _compare_recorded(self, run: Run, entries: list[Entry]) -> web.Response:
        if len(entries) != 1:
            raise web.HTTPBadRequest(text="name one replayed trajectory of this run: ?id=…\n")
        record = await asyncio.to_thread(self.index.read_record, entries[0])
        with self.index.lock:
            recorded = self._recorded_of(run, record)
        if recorded is None:
            raise web.HTTPNotFound(text="this is no replay of a trajectory the viewer serves\n")
        columns = [(*recorded, "recorded"), (run, entries[0], "replayed")]
        return await self._compare(columns, run)

    async def _compare(
        self, columns: Sequence[tuple[Run, Entry, str | None]], run: Run
    ) -> web.Response:
        """Each column's trajectory (its run, its entry, what it is) turn by turn."""
        entries = [entry for _, entry, _ in columns]
        records = await asyncio.to_thread(lambda: [self.index.read_record(e) for e in entries])
        trajectories = [views.trajectory_view(r, self.piece) for r in records]
        divergence = views.first_divergence(trajectories)
        rows = max(len(t.turns) for t in trajectories)
        return self._render(
            "compare.html", run=run, columns=columns, trajectories=trajectories,
            divergence=divergence, rows=rows, split_at=views.split_at,
            key=(entries[-1].validate, entries[-1].step),
        )  # fmt: skip

    async def prompt_page(self, request: web.Request) -> web.Response:
        """One prompt at every step where it was kept: how the answers to it changed."""
        await self._refreshed()
        digest = request.match_info["hash"]
        with self.index.lock:
            run = self._run(request)
            entries = list(run.by_prompt.get(digest, ()))
        if not entries:
            raise web.HTTPNotFound(text="no trajectory of this run was asked this prompt\n")
        steps = history.steps_of_prompt(entries)
        page = max(1, int(_float_arg(request.query.get("page")) or 1))
        pages = max(1, math.ceil(len(steps) / STEPS_PER_PAGE))
        page = min(page, pages)
        shown = steps[(page - 1) * STEPS_PER_PAGE : page * STEPS_PER_PAGE]

        def read() -> str | None:
            history.read_answers(shown, self.index.read_record, self.piece)
            try:
                return views.sample_prompt(self.index.read_record(steps[0].rollouts[0]))
            except (OSError, ValueError):
                return None

        prompt = await asyncio.to_thread(read)
        training = [s.row for s in steps if not s.key[0] and s.key[1] is not None]
        return self._render(
            "prompt.html", run=run, digest=digest, steps=shown, prompt=prompt,
            total_steps=len(steps), rollouts=len(entries), plots=_plots(training),
            page=page, pages=pages,
        )  # fmt: skip

    async def drift_page(self, request: web.Request) -> web.Response:
        """The run's drifting calls (retokenization drift), each with its first differing
        token: trajectories in step order, a page of them at a time, each record read again."""
        await self._refreshed()
        with self.index.lock:
            run = self._run(request)
            entries = [
                entry
                for key in run.step_keys()
                for entry in sorted(run.steps[key].entries, key=lambda e: e.start)
                if entry.drift
            ]
            drifting = sum(entry.drift for entry in entries)
        pages = max(1, math.ceil(len(entries) / DRIFT_PER_PAGE))
        page = min(max(1, int(_float_arg(request.query.get("page")) or 1)), pages)
        shown = entries[(page - 1) * DRIFT_PER_PAGE : page * DRIFT_PER_PAGE]

        def read() -> list[views.DriftingCall]:
            found = []
            for entry in shown:
                try:
                    records = self._read_parts(entry)
                except (OSError, ValueError):  # a line gone or changed since it was indexed
                    continue
                found.extend(views.drifting_calls(entry, joined(records)))
            return found

        rows = await asyncio.to_thread(read)
        return self._render(
            "drift.html", run=run, rows=rows, trajectories=len(entries), calls=drifting,
            page=page, pages=pages,
        )  # fmt: skip

    async def search_page(self, request: web.Request) -> web.Response:
        """Trajectories of every step of the run, by text and filters (`search.py`)."""
        await self._refreshed()
        query = search.Query.of(request.query)

        def find() -> tuple[Run, search.Results | None]:
            with self.index.lock:
                run = self._run(request)
                if query.problems or not query.asked:
                    return run, None
                return run, search.search(self.text, run, query)

        run, results = await asyncio.to_thread(find)
        status = 400 if query.problems or (results is not None and results.error) else 200
        response = self._render(
            "search.html", run=run, query=query, params=request.query, results=results,
            filters={k: v for k, v in request.query.items() if k != "page" and v},
        )  # fmt: skip
        response.set_status(status)
        return response

    async def generation(self, request: web.Request) -> web.Response:
        return web.json_response({"generation": await self._refreshed()})

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        data = resources.files("trace_proxy.ui").joinpath("static").joinpath(name).read_bytes()
        return web.Response(body=data, content_type=STATIC[name])


# --- page data -------------------------------------------------------------------------------


def _steps_asked(run: Run, entry: Entry) -> int:
    """At how many steps (training and validation) `entry`'s prompt was kept."""
    if entry.prompt_hash is None:
        return 0
    return len({(e.validate, e.step) for e in run.by_prompt.get(entry.prompt_hash, ())})


def _run_row(run: Run) -> dict[str, Any]:
    span = run.time_span()
    train = [k for k in run.steps if not k[0]]
    return {
        "run": run, "url": run_url(run), "steps": len(train),
        "validation_steps": len(run.steps) - len(train), "trajectories": run.trajectories,
        "calls": run.calls, "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.completion_tokens, "errors": run.errors,
        "events": len(run.events), "unreadable": run.unreadable, "drift": run.drift,
        "start": span[0] if span else None, "end": span[1] if span else None,
    }  # fmt: skip


def _step_row(key: StepKey, step: Any) -> dict[str, Any]:
    stats = step.stats
    summary = step.summary or {}
    return {
        "key": key, "validate": key[0], "step": key[1], "name": step_name(key),
        "trajectories": stats.trajectories, "seen": summary.get("trajectories_seen"),
        "kept": summary.get("trajectories_kept"), "reward_mean": stats.reward_mean,
        "reward_std": stats.reward_std, "rewarded": stats.rewarded,
        "length": stats.per_trajectory(stats.completion_tokens),
        "turns": stats.per_trajectory(stats.turns),
        "tool_calls": stats.per_trajectory(stats.tool_calls),
        "tool_errors": stats.tool_errors, "errors": stats.errors,
    }  # fmt: skip


def _plots(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Small line plots across steps: reward (mean, with a band of one standard deviation),
    response length and tool calls per trajectory."""
    numbered = [r for r in rows if r["step"] is not None]
    if len(numbered) < 1:
        return []
    plots = []
    for field, title in (
        ("reward_mean", "reward (mean ± sd)"),
        ("length", "response tokens per trajectory"),
        ("tool_calls", "tool calls per trajectory"),
    ):
        points = [(r["step"], r[field], r["reward_std"] or 0.0) for r in numbered
                  if r[field] is not None]  # fmt: skip
        if points:
            plots.append(_plot(title, points, band=field == "reward_mean"))
    return plots


PLOT_W, PLOT_H, PAD = 300.0, 90.0, 6.0
MAX_BARS = 30  # values of a version histogram; larger ones share the last bar


def _version_plots(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """How stale the run's training samples were: how many of them by versions their
    generation spans past its first (max - min), and by versions behind the newest the proxy
    had seen when they closed (latest - max). Only samples whose versions are integers."""
    plots = []
    for field, title, name in (
        ("version_spread", "samples by versions spanned (max - min version)", "version-spread"),
        ("version_lag", "samples by versions behind the newest at close", "version-lag"),
    ):
        values = [v for v in (getattr(e, field) for e in entries) if v is not None]
        if values:
            plots.append(_bars(name, title, values))
    return plots


def _bars(name: str, title: str, values: list[int]) -> dict[str, Any]:
    """A histogram of small integers drawn as SVG bars, one per value from the least."""
    first = min(0, min(values))
    counts: dict[int, int] = {}
    for value in values:
        bucket = min(value, first + MAX_BARS - 1)
        counts[bucket] = counts.get(bucket, 0) + 1
    last = max(counts)
    top = max(counts.values())
    width = (PLOT_W - 2 * PAD) / (last - first + 1)
    bars = []
    for position, value in enumerate(range(first, last + 1)):
        count = counts.get(value, 0)
        height = (PLOT_H - 2 * PAD) * count / top
        shown = f"{value}+" if value == first + MAX_BARS - 1 and value < max(values) else value
        bars.append({
            "x": PAD + position * width + 1, "w": max(1.0, width - 2), "h": height,
            "y": PLOT_H - PAD - height, "value": shown, "count": count,
            "label": f"{shown}: {count} sample{'s' if count != 1 else ''}",
        })  # fmt: skip
    return {"id": name, "title": title, "bars": bars, "w": PLOT_W, "h": PLOT_H,
            "first": first, "last": bars[-1]["value"], "top": top,
            "samples": len(values)}  # fmt: skip


def _plot(title: str, points: list[tuple[int, float, float]], band: bool) -> dict[str, Any]:
    xs = [p[0] for p in points]
    lows = [p[1] - (p[2] if band else 0) for p in points]
    highs = [p[1] + (p[2] if band else 0) for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(lows), max(highs)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 1, y1 + 1

    def x(step: float) -> float:
        return PAD + (PLOT_W - 2 * PAD) * ((step - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def y(value: float) -> float:
        return PLOT_H - PAD - (PLOT_H - 2 * PAD) * (value - y0) / (y1 - y0)

    dots = [{"x": x(s), "y": y(v), "label": f"step {s}: {_num(v)}"} for s, v, _ in points]
    line = " ".join(f"{d['x']:.1f},{d['y']:.1f}" for d in dots)
    area = ""
    if band:
        top = [f"{x(s):.1f},{y(v + sd):.1f}" for s, v, sd in points]
        bottom = [f"{x(s):.1f},{y(v - sd):.1f}" for s, v, sd in reversed(points)]
        area = " ".join(top + bottom)
    return {"title": title, "line": line, "area": area, "dots": dots, "w": PLOT_W, "h": PLOT_H,
            "low": _num(y0), "high": _num(y1), "first": x0, "last": x1}  # fmt: skip


def _timeline(view: views.Trajectory) -> dict[str, Any]:
    width, row = 900.0, 18.0
    total = max(view.duration, max((s.end or s.start for s in view.spans), default=0.0), 1e-6)

    def x(t: float) -> float:
        return 120.0 + (width - 130.0) * max(0.0, t) / total

    bars = []
    for n, span in enumerate(view.spans):
        end = span.end if span.end is not None else total
        label = f"↳ {span.label}" if span.kind == "segment" else f"{span.kind} {span.label}"
        bars.append({
            "span": span, "y": n * row + 2, "x": x(span.start),
            "w": max(1.5, x(end) - x(span.start)),
            "fb": None if span.first_byte is None else x(span.first_byte),
            "label": label,
            "title": f"{label}: {span.start:.3f}s → "
            + ("?" if span.end is None else f"{span.end:.3f}s ({span.end - span.start:.3f}s)")
            + ("" if span.first_byte is None else f", first byte {span.first_byte:.3f}s"),
        })  # fmt: skip
    syncs = [
        {"x": x(sync.at), "before": sync.before, "after": sync.after,
         "title": f"weight sync at {sync.at:.3f}s: version {sync.before} → {sync.after}"}
        for sync in view.syncs
    ]  # fmt: skip
    return {"bars": bars, "width": width, "height": len(bars) * row + 20, "total": total,
            "axis_y": len(bars) * row + 14, "syncs": syncs}  # fmt: skip


def _sort_groups(groups: list[views.Group], sort: str) -> None:
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


# --- formatting ------------------------------------------------------------------------------


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def _when(value: Any) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return DASH
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + " UTC"


def _secs(value: Any) -> str:
    return DASH if not isinstance(value, (int, float)) else f"{value:.2f}s"


def _quoted(value: Any) -> str:
    """A token's text as a JSON string: quoted, its spaces and line breaks visible."""
    return DASH if value is None else orjson.dumps(str(value)).decode()


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        try:  # arguments are JSON text: shown indented when they parse
            return orjson.dumps(orjson.loads(value), option=orjson.OPT_INDENT_2).decode()
        except orjson.JSONDecodeError:
            return value
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS,
                        default=str).decode()  # fmt: skip


def _float_arg(value: str | None) -> float | None:
    if not value:
        return None
    try:
        result = float(value)
    except ValueError:
        return None
    return result if math.isfinite(result) else None


# --- serving ---------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def start(
    stores: Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8300,
    piece: views.Piece | None = None,
    index_dir: str | Path | None = None,
) -> tuple[web.AppRunner, str, Viewer]:
    """Index the stores and listen; returns the runner (to clean up), the URL and the viewer.
    The search's index is a temporary directory in `index_dir` (else the system's)."""
    index = StoreIndex(stores)
    text = TextIndex(index_dir)
    text.attach(index)
    try:
        await asyncio.to_thread(index.refresh, True)
    except BaseException:
        text.close()
        raise
    viewer = Viewer(index, piece, text)
    limits = ClientLimits.of(Settings())  # the proxy's defaults
    runner = LimitedAppRunner(viewer.app(), limits, Rejections(None, "the viewer"), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()  # the search's index removed with the app
        raise
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    if is_loopback(host):
        names = {host.lower(), "localhost", "127.0.0.1", "[::1]"}
        viewer.allowed_hosts = {f"{name}:{bound}" for name in names}
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}/", viewer


def index_dir_problem(index_dir: str | None, stores: Sequence[str]) -> str | None:
    """Why the search's index cannot go in `index_dir`: the viewer never writes into a store."""
    if index_dir is None:
        return None
    place = Path(index_dir).resolve()
    if not place.is_dir():
        return f"not a directory: {index_dir}"
    for store in stores:
        if place.is_relative_to(Path(store).resolve()):
            return f"{index_dir} is inside the store {store}, which the viewer only reads"
    return None


def token_pieces(source: str) -> views.Piece:
    """Each token id's text, from a tokenizer (a local directory: nothing is downloaded)."""
    from trace_proxy.text.token2text import decoder_for, load_tokenizer

    decode = decoder_for(load_tokenizer(source), skip_special_tokens=False)
    return lambda token: decode([token])


def run_ui(
    stores: Sequence[str],
    host: str,
    port: int,
    tokenizer: str | None = None,
    index_dir: str | None = None,
) -> int:
    from trace_proxy.text.token2text import TokenizerError

    missing = [s for s in stores if not Path(s).is_dir()]
    if missing:
        print(f"trace-proxy: error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    problem = index_dir_problem(index_dir, stores)
    if problem:
        print(f"trace-proxy: error: invalid value for --index-dir: {problem}", file=sys.stderr)
        return 2
    try:
        piece = token_pieces(tokenizer) if tokenizer else None
    except TokenizerError as exc:
        print(f"trace-proxy: error: invalid value for --tokenizer: {exc}", file=sys.stderr)
        return 2
    print(f"trace-proxy ui: indexing {', '.join(stores)}...", flush=True)
    left = leftovers([Path(store) for store in stores])
    if left:
        print(printable(notice(left)), file=sys.stderr, flush=True)

    async def serve() -> int:
        try:
            runner, url, _ = await start(stores, host, port, piece, index_dir)
        except OSError as exc:
            print(f"trace-proxy: error: cannot listen on {host}:{port}: {exc.strerror or exc}",
                  file=sys.stderr)  # fmt: skip
            return 1
        except SearchUnavailable as exc:
            print(f"trace-proxy: error: {exc}", file=sys.stderr)
            return 2
        print(f"trace-proxy ui: {url}  (stores: {', '.join(stores)}; Ctrl-C stops)", flush=True)
        if not is_loopback(host):
            print(f"trace-proxy ui: warning: listening on {host}: whoever can reach this port "
                  "can read every record of these stores", file=sys.stderr, flush=True)  # fmt: skip
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        await runner.cleanup()
        return 0

    return asyncio.run(serve())
