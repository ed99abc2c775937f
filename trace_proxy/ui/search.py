"""Searching a run: text through the FTS5 index (`textindex.py`), the rest through entries.

A search names words (or, asked for, an FTS5 query) and filters: reward range, status, errors,
ambiguous key, late trajectory, late reward, step range, training or validation, tool name.
Text, ambiguity, lateness and tool names are asked of SQLite; reward, status, errors and steps
are read from the in-memory entries, so a late reward counts as soon as it is indexed. Results
are in step order (training first), then group and rollout; only a page's snippets are made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from trace_proxy.ui.index import Entry, Run
from trace_proxy.ui.textindex import Hit, Marks, QueryError, TextIndex, fts_query, highlighted

PER_PAGE = 50
TEXT_CAP = 1_000  # characters of a query's text


@dataclass(frozen=True)
class Query:
    """A search as its URL states it; `problems` says what of it could not be understood."""

    text: str = ""
    raw: bool = False  # `text` is FTS5 syntax
    min_reward: float | None = None
    max_reward: float | None = None
    status: str = ""
    errors: bool = False
    ambiguous: bool = False
    late: bool = False
    late_reward: bool = False
    min_step: int | None = None
    max_step: int | None = None
    split: str = ""  # training | validation | "" (both)
    tool: str = ""
    page: int = 1
    problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, params: Mapping[str, str]) -> Query:
        problems: list[str] = []

        def number(name: str) -> float | None:
            value = params.get(name, "").strip()
            if not value:
                return None
            try:
                result = float(value)
            except ValueError:
                result = math.nan
            if not math.isfinite(result):
                problems.append(f"{name} is not a number")
                return None
            return result

        def whole(name: str) -> int | None:
            value = number(name)
            if value is not None and value != int(value):
                problems.append(f"{name} is not a whole number")
                return None
            return None if value is None else int(value)

        split = params.get("split", "")
        if split not in ("", "training", "validation"):
            problems.append("split is training or validation")
            split = ""
        return cls(
            text=params.get("q", "").strip()[:TEXT_CAP], raw=_flag(params, "fts"),
            min_reward=number("min_reward"), max_reward=number("max_reward"),
            status=params.get("status", "")[:64], errors=_flag(params, "errors"),
            ambiguous=_flag(params, "ambiguous"), late=_flag(params, "late"),
            late_reward=_flag(params, "late_reward"), min_step=whole("min_step"),
            max_step=whole("max_step"), split=split, tool=params.get("tool", "")[:256],
            page=max(1, min(whole("page") or 1, 1_000_000)), problems=tuple(problems),
        )  # fmt: skip

    @property
    def asked(self) -> bool:
        """Whether it asks for anything (an empty form shows no results)."""
        return bool(
            self.text or self.min_reward is not None or self.max_reward is not None
            or self.status or self.errors or self.ambiguous or self.late or self.late_reward
            or self.min_step is not None or self.max_step is not None or self.split or self.tool
        )  # fmt: skip

    def keeps(self, entry: Entry) -> bool:
        """The filters the in-memory entry answers."""
        reward = entry.reward
        if self.min_reward is not None and (reward is None or not reward >= self.min_reward):
            return False
        if self.max_reward is not None and (reward is None or not reward <= self.max_reward):
            return False
        if self.status and entry.status != self.status:
            return False
        if self.errors and not (entry.errors or entry.tool_errors or entry.status != "ok"):
            return False
        if self.late_reward and not entry.annotated:
            return False
        if self.split and entry.validate != (self.split == "validation"):
            return False
        if self.min_step is not None and (entry.step is None or entry.step < self.min_step):
            return False
        return self.max_step is None or (entry.step is not None and entry.step <= self.max_step)


@dataclass
class Result:
    entry: Entry
    marks: Marks
    column: str | None = None  # where the text matched
    snippet: list[tuple[str, bool]] = field(default_factory=list)  # (text, is a hit)


@dataclass
class Results:
    total: int = 0
    page: int = 1
    pages: int = 1
    rows: list[Result] = field(default_factory=list)
    error: str | None = None  # the query could not be run: why, for the user


def search(text_index: TextIndex, run: Run, query: Query) -> Results:
    """The page of `run`'s trajectories `query` finds. Call with the store index's lock held."""
    match = (query.text if query.raw else fts_query(query.text)) or None
    if query.text and match is None:
        return Results(error="the text has no words to search for")
    hits: dict[str, Hit] = {}
    found: list[Entry] = []
    if match is not None or query.ambiguous or query.late or query.tool:
        try:
            for hit in text_index.find(
                run, match, ambiguous=query.ambiguous, late=query.late, tool=query.tool or None
            ):
                entry = run.by_id.get(hit.id)
                if entry is not None and entry.id not in hits and query.keeps(entry):
                    hits[entry.id] = hit
                    found.append(entry)
        except QueryError as exc:
            return Results(error=f"the search could not be run: {exc}")
    else:
        found = [e for step in run.steps.values() for e in step.entries if query.keeps(e)]
    found.sort(key=_order)
    pages = max(1, math.ceil(len(found) / PER_PAGE))
    page = min(query.page, pages)
    shown = found[(page - 1) * PER_PAGE : page * PER_PAGE]
    results = Results(total=len(found), page=page, pages=pages)
    known = {e.id: (hits[e.id].doc, hits[e.id].marks) for e in shown if e.id in hits}
    missing = [e.id for e in shown if e.id not in known]
    known.update(text_index.marks(run, missing))
    snippets: dict[int, tuple[str, str]] = {}
    if match is not None:
        try:
            snippets = text_index.snippets(match, [known[e.id][0] for e in shown if e.id in known])
        except QueryError as exc:
            return Results(error=f"the search could not be run: {exc}")
    for entry in shown:
        doc, marks = known.get(entry.id, (0, Marks(False, False)))
        column, snippet = snippets.get(doc, (None, ""))
        results.rows.append(Result(entry, marks, column, highlighted(snippet)))
    return results


def _order(entry: Entry) -> tuple[bool, int, int, int, str]:
    return (
        entry.validate, -1 if entry.step is None else entry.step,
        -1 if entry.sample_index is None else entry.sample_index,
        -1 if entry.rollout_n is None else entry.rollout_n, entry.id,
    )  # fmt: skip


def _flag(params: Mapping[str, str], name: str) -> bool:
    return params.get(name, "") not in ("", "0")
