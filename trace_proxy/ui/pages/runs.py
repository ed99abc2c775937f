"""The stores' runs (`/`) and a run's steps with its plots across them (`/run/…/`)."""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from trace_proxy.ui.index import Run, StepKey
from trace_proxy.ui.plots import step_plots, version_plots
from trace_proxy.ui.site import RUN, Site
from trace_proxy.ui.urls import run_url, step_name


def attach(app: web.Application, site: Site) -> None:
    app.router.add_get("/", partial(runs_page, site))
    app.router.add_get(RUN + "/", partial(run_page, site))


async def runs_page(site: Site, request: web.Request) -> web.Response:
    await site.refreshed()
    with site.index.lock:
        runs = sorted(site.index.runs.values(), key=lambda r: r.ref)
        rows = [run_row(run) for run in runs]
    return site.render("runs.html", rows=rows)


async def run_page(site: Site, request: web.Request) -> web.Response:
    await site.refreshed()
    with site.index.lock:
        run = site.run(request)
        rows = [step_row(key, run.steps[key]) for key in run.step_keys()]
        train = [r for r in rows if not r["validate"]]
        validation = [r for r in rows if r["validate"]]
        row = run_row(run)
        training = [e for key in run.step_keys() if not key[0]
                    for e in run.steps[key].entries]  # fmt: skip
        versions = version_plots(training)
    return site.render(
        "run.html", run=run, row=row, train=train, validation=validation,
        plots=step_plots(train), validation_plots=step_plots(validation),
        version_plots=versions,
    )  # fmt: skip


def run_row(run: Run) -> dict[str, Any]:
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


def step_row(key: StepKey, step: Any) -> dict[str, Any]:
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
