"""Searching a run: text through the FTS5 index (`textindex.py`), the rest through entries.

A search names words (or, asked for, an FTS5 query) and filters: reward range, status, errors,
ambiguous key, late trajectory, late reward, step range, training or validation, tool name.
Text, ambiguity, lateness and tool names are asked of SQLite; reward, status, errors and steps
are read from the in-memory entries, so a late reward counts as soon as it is indexed. Results
are in step order (training first), in each step in the order the store holds them; only a
page's marks and snippets are asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from trace_proxy.ui.index import Entry, Run, StepKey
from trace_proxy.ui.textindex import Marks, QueryError, TextIndex, fts_query, highlighted

PER_PAGE = 50
TEXT_CAP = 1_000  # characters of a query's text
NO_MARKS = Marks(ambiguous=False, late=False)


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
    docs: dict[int, int] = {}  # id(entry) -> its matching document
    if match is not None or query.ambiguous or query.late or query.tool:
        try:
            hits = text_index.find(
                run, match, ambiguous=query.ambiguous, late=query.late, tool=query.tool or None
            )
        except QueryError as exc:
            return Results(error=f"the search could not be run: {exc}")
        by_step: dict[StepKey, list[Entry]] = {}
        for doc, entry in hits:
            if query.keeps(entry):
                by_step.setdefault((entry.validate, entry.step), []).append(entry)
                docs[id(entry)] = doc
        found = [e for key in run.step_keys() for e in by_step.get(key, ())]
    else:
        found = [e for key in run.step_keys() for e in run.steps[key].entries if query.keeps(e)]
    pages = max(1, math.ceil(len(found) / PER_PAGE))
    page = min(query.page, pages)
    shown = found[(page - 1) * PER_PAGE : page * PER_PAGE]
    results = Results(total=len(found), page=page, pages=pages)
    if docs:
        shown_docs = [docs[id(e)] for e in shown]
        marks = text_index.marks_of_docs(shown_docs)
    else:  # found in memory: their documents asked by id
        known = text_index.marks(run, [e.id for e in shown])
        shown_docs = [known.get(e.id, (0, NO_MARKS))[0] for e in shown]
        marks = {doc: mark for doc, mark in known.values()}
    snippets: dict[int, tuple[str, str]] = {}
    if match is not None:
        try:
            snippets = text_index.snippets(match, shown_docs)
        except QueryError as exc:
            return Results(error=f"the search could not be run: {exc}")
    for entry, doc in zip(shown, shown_docs, strict=True):
        column, snippet = snippets.get(doc, (None, ""))
        results.rows.append(Result(entry, marks.get(doc, NO_MARKS), column, highlighted(snippet)))
    return results


def _flag(params: Mapping[str, str], name: str) -> bool:
    return params.get(name, "") not in ("", "0")
