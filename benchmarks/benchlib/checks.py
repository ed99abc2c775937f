"""Correctness checks made while benchmarking: a fast proxy that changes bytes or loses
records is not a result. Each check says what was compared and what was found."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from benchlib.recording import StoreReport, total
from benchlib.report import DIRECT, Cell, Checks
from benchlib.workload import parse_mode

TRACE_PROXY = "trace-proxy"
UNRECORDED = "trace-proxy-unrecorded"
LITELLM = "litellm"
_PY_PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Exception")
_NGINX_PROBLEM = re.compile(r"\[(warn|error|crit|alert|emerg)\]")


def check_bodies(cells: list[Cell], checks: Checks) -> None:
    """Every response matched the upstream's exact bytes, and each proxy's per-turn sha256
    equals what direct got."""
    reference = {c.mode: c.load["digests"] for c in cells if c.system == DIRECT}
    for system in dict.fromkeys(c.system for c in cells):
        mine = [c for c in cells if c.system == system]
        sent = sum(c.load["sent"] for c in mine)
        mismatched = sum(c.load["mismatched"] for c in mine)
        not_ok = sum(sum(n for s, n in c.load["statuses"].items() if s != "200") for c in mine)
        failed = sum(sum(c.load["errors"].values()) for c in mine)
        digests_differ = [
            c for c in mine if c.mode in reference and c.load["digests"] != reference[c.mode]
        ]
        if system == LITELLM:  # re-serialises every body by design: statuses only
            checks.add(f"bodies {system}", not (not_ok or failed),
                       f"{sent} responses, re-serialised by LiteLLM so not compared byte for "
                       f"byte: {not_ok} non-200, {failed} transport errors")  # fmt: skip
            continue
        sample = next((c.load["mismatch_sample"] for c in mine if c.load["mismatch_sample"]), "")
        errors = Counter(e for c in mine for e in c.load["errors"])
        detail = (
            f"{sent} responses compared with the upstream's bytes: {mismatched} differ, "
            f"{not_ok} non-200, {failed} transport errors"
            + (
                ""
                if system == DIRECT
                else f"; per-turn sha256 equal to direct's in "
                f"{len(mine) - len(digests_differ)}/{len(mine)} cells"
            )
            + (f"; first difference: {sample}" if sample else "")
            + (f"; errors: {dict(errors.most_common(3))}" if errors else "")
        )
        ok = not (mismatched or not_ok or failed or digests_differ)
        checks.add(f"bodies {system}", ok, detail)


def check_waits(cells: list[Cell], checks: Checks) -> None:
    """With a slow upstream (`-500ms` modes), every measured answer said how long the upstream
    waited, so every added latency is measured, none guessed."""
    slow = [c for c in cells if parse_mode(c.mode).latency_ms is not None]
    if not slow:
        return
    unwaited = sum(int(c.load["unwaited"]) for c in slow)
    measured = sum(int(c.load["measured"]) for c in slow)
    overheads = sum(int(c.load["overheads"]) for c in slow)
    checks.add(
        "upstream waits",
        unwaited == 0 and overheads == measured,
        f"{overheads} of {measured} measured answers in the slow-upstream cells said how long the "
        f"upstream waited; {unwaited} did not",
    )


def check_store(store: StoreReport, cells: list[Cell], checks: Checks) -> None:
    """The jsonl store holds one call per request sent through trace-proxy, grouped as sent:
    recorded, or counted in its trajectory as dropped (capture fell behind)."""
    mine = [c for c in cells if c.system == TRACE_PROXY]
    sent = sum(c.load["sent"] for c in mine)
    started = sum(c.load["trajectories"] for c in mine)
    steps_off = [
        c.step
        for c in mine
        if store.calls_by_step[c.step] != c.load["sent"]
        or store.trajectories_by_step[c.step] != c.load["trajectories"]
    ]
    checks.add(
        "store counts",
        store.calls + store.calls_dropped == sent
        and store.trajectories == started
        and not steps_off,
        f"expected {sent} calls in {started} trajectories, found {store.calls} calls recorded and "
        f"{store.calls_dropped} counted as dropped in {store.trajectories} trajectories "
        f"({store.files} files); steps whose counts differ: "
        f"{steps_off or 'none'}; close reasons {dict(store.close_reasons)}",
    )
    checks.add(
        "store content",
        not (
            store.errors
            or store.unparsed
            or store.token_mismatches
            or store.stream_flag_wrong
            or store.later_parts
        ),
        f"calls with error {store.errors}, unparsed {store.unparsed}, wrong stream flag "
        f"{store.stream_flag_wrong}; trajectories split into parts {store.later_parts}; calls "
        f"whose rebuilt prompt or output token ids differ from what was sent/returned "
        f"{store.token_mismatches}"
        + (f" (first: {store.mismatch_sample})" if store.mismatch_sample else ""),
    )


def check_proxy_metrics(samples: dict[str, float], cells: list[Cell], checks: Checks) -> None:
    """trace-proxy's own accounting: every request a 2xx, every generate call recorded or
    counted as dropped, the same drops as the store's trajectories count (and nothing recorded
    for the unrecorded route). Whether anything was dropped is a target, judged per cell."""
    mine = [c for c in cells if c.system == TRACE_PROXY]
    recorded = sum(c.load["sent"] for c in mine)
    sent = recorded + sum(c.load["sent"] for c in cells if c.system == UNRECORDED)
    in_store = sum(c.dropped or 0 for c in mine)
    calls = total(samples, "trace_proxy_calls_recorded_total")
    dropped = total(samples, "trace_proxy_capture_dropped_total")
    export_dropped = total(samples, "trace_proxy_export_dropped_total")
    upstream_errors = total(samples, "trace_proxy_upstream_errors_total")
    ok_requests = total(samples, "trace_proxy_requests_total", 'status="2xx"')
    all_requests = total(samples, "trace_proxy_requests_total")
    checks.add(
        "trace-proxy metrics",
        not (export_dropped or upstream_errors)
        and ok_requests == all_requests == sent
        and calls + dropped == recorded
        and dropped == in_store,
        f"requests {all_requests:.0f} (2xx {ok_requests:.0f}, sent {sent}); calls recorded "
        f"{calls:.0f} and capture dropped {dropped:.0f} (sent on recorded routes {recorded}; "
        f"dropped in the store's trajectories {in_store}); export dropped "
        f"{export_dropped:.0f}; upstream errors {upstream_errors:.0f}" + _where_dropped(cells),
    )


def _where_dropped(cells: list[Cell]) -> str:
    """The cells whose calls the store counts as dropped, summed over rounds."""
    sent: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for cell in cells:
        if cell.system == TRACE_PROXY and cell.dropped:
            where = f"{cell.mode} c={cell.concurrency}"
            sent[where] += int(cell.load["sent"])
            dropped[where] += cell.dropped
    if not dropped:
        return ""
    parts = [f"{at} {n} of {sent[at]} ({n / sent[at]:.0%})" for at, n in dropped.items()]
    return " (dropped in " + "; ".join(parts) + ")"


def check_drain(cells: list[Cell], checks: Checks) -> None:
    """The recording backlog emptied after every trace-proxy cell, within the bound."""
    mine = [c for c in cells if c.system == TRACE_PROXY]
    if not mine:
        return
    drains = sorted(c.drain_s or 0.0 for c in mine)
    backlog = max(c.backlog or 0 for c in mine)
    checks.add(
        "recording kept up",
        all(c.drained for c in mine),
        f"after each of {len(mine)} cells, records were written within "
        f"{drains[len(drains) // 2]:.2f} s (median), {drains[-1]:.2f} s (max); largest backlog "
        f"when the load stopped: {backlog} calls not yet parsed",
    )


def check_upstream(stats: dict[str, int], cells: list[Cell], checks: Checks) -> None:
    """The upstream saw each request exactly once, with its exact body (no retries, no edits);
    LiteLLM re-serialises requests by design, so its requests only have to mean the same."""
    sent = sum(c.load["sent"] for c in cells)
    rewritten = sum(c.load["sent"] for c in cells if c.system == LITELLM)
    checks.add(
        "upstream saw every request once, unchanged",
        stats["requests"] == sent
        and stats["unknown"] == 0
        and stats.get("reserialized", 0) == rewritten,
        f"{stats['requests']} requests received for {sent} sent; "
        f"{stats['unknown']} with a body that differs from the one sent"
        + (
            f"; {stats.get('reserialized', 0)} re-serialised by LiteLLM (of {rewritten})"
            if rewritten
            else ""
        ),
    )


def check_exit(name: str, code: int, seconds: float, checks: Checks) -> None:
    checks.add(
        f"{name} stops cleanly on SIGTERM",
        code == 0,
        f"exit code {code} after {seconds:.2f} s",
    )


def check_log(name: str, path: Path | None, checks: Checks, nginx: bool = False) -> None:
    """Warnings and errors a process printed during the run (first few quoted)."""
    if path is None or not path.exists():
        return
    pattern = _NGINX_PROBLEM if nginx else _PY_PROBLEM
    lines = [line for line in path.read_text(errors="replace").splitlines() if pattern.search(line)]
    shown = "; ".join(line.strip()[:200] for line in lines[:3])
    checks.add(
        f"{name} output",
        not lines,
        f"{len(lines)} warning/error lines" + (f", first: {shown}" if lines else ""),
    )
