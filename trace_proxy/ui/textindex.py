"""The viewer's full-text index: a trajectory's words in an SQLite FTS5 table on disk.

Searching 100,000 records by reading each again takes minutes; keeping their text in memory
takes gigabytes. So as `StoreIndex` reads a trajectory's line it hands the record here
(`added`), and its searchable text goes into an FTS5 table in a file of the viewer's own (a
temporary directory, or one `--index-dir` names; never the store, which the viewer only reads),
removed when the viewer stops. A query gives record ids; what changes later (a late reward) is
read from the in-memory entries, so it is never written twice.

What is indexed, per trajectory, in four columns: `prompt` (each call's stored prompt: chat
messages, text, else its decoded `prompt_text`; a shared prompt stores only what it adds),
`response` (each output's text, else its decoded `response_text`, and its reasoning),
`tools` (tool names, arguments and results, from tool spans and from outputs' tool calls) and
`errors` (calls' errors and unparsed reasons, tool spans' errors). Each piece keeps its first
PIECE_CAP characters and each column its first COLUMN_CAP, so a trajectory costs at most
4 x COLUMN_CAP characters however long its prompts. Beside them: whether the key was inferred
ambiguously, whether the trajectory closed after its step ended (`late`), and its tool names.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from trace_proxy.ui.index import Entry, Run, StoreIndex, as_dict, as_list

PIECE_CAP = 2_000  # characters of one message, response, argument or error
COLUMN_CAP = 8_000  # characters of one column of one trajectory
COLUMNS = ("prompt", "response", "tools", "errors")
BATCH = 2_000  # rows buffered before they are written
HIT_START, HIT_END = "\x02", "\x03"  # around a hit in a snippet; removed from indexed text
SNIPPET_TOKENS = 16


class QueryError(ValueError):
    """A query FTS5 refused (raw syntax): its message is for the user."""


@dataclass(frozen=True, slots=True)
class Marks:
    """What a search filters on that the in-memory entry does not hold."""

    ambiguous: bool
    late: bool


class Hit(NamedTuple):
    """A matching record, as SQLite gives it (a tuple: a search can find 100,000)."""

    doc: int
    id: str
    ambiguous: int
    late: int

    @property
    def marks(self) -> Marks:
        return Marks(bool(self.ambiguous), bool(self.late))


def searchable(record: dict[str, Any]) -> dict[str, str]:
    """A record's text by column, capped (see the module's docstring)."""
    columns: dict[str, list[str]] = {name: [] for name in COLUMNS}
    for call in as_list(record.get("calls")):
        call = as_dict(call)
        prompt = as_dict(call.get("prompt"))
        messages = [as_dict(m) for m in as_list(prompt.get("messages"))]
        pieces = [_message_text(m) for m in messages]
        if isinstance(prompt.get("text"), str):
            pieces.append(prompt["text"])
        if not pieces and isinstance(call.get("prompt_text"), str):
            pieces.append(call["prompt_text"])
        columns["prompt"] += pieces
        for message in messages:
            columns["tools"] += _tool_calls_text(message.get("tool_calls"))
        for output in as_list(call.get("outputs")):
            output = as_dict(output)
            text = output.get("text")
            if not isinstance(text, str):
                text = output.get("response_text")
            columns["response"] += [t for t in (text, output.get("reasoning"))
                                    if isinstance(t, str)]  # fmt: skip
            columns["tools"] += _tool_calls_text(output.get("tool_calls"))
        columns["errors"] += _error_text(call.get("error"))
        if isinstance(call.get("unparsed"), str):
            columns["errors"].append(call["unparsed"])
    for tool in as_list(record.get("tools")):
        tool = as_dict(tool)
        columns["tools"] += [_text(tool.get(k)) for k in ("name", "arguments", "result")]
        columns["errors"] += _error_text(tool.get("error"))
    return {name: _capped(pieces) for name, pieces in columns.items()}


def marks_of(record: dict[str, Any]) -> Marks:
    key = as_dict(record.get("key"))
    sources = as_dict(key.get("sources"))
    ambiguous = any(isinstance(v, str) and "ambiguous" in v for v in sources.values())
    late = any(
        as_dict(a).get("field") == "step" and as_dict(a).get("source") == "sampler"
        for a in as_list(record.get("annotations"))
    )
    return Marks(ambiguous, late)


def tool_names(record: dict[str, Any]) -> list[str]:
    names = [as_dict(t).get("name") for t in as_list(record.get("tools"))]
    for call in as_list(record.get("calls")):
        for output in as_list(as_dict(call).get("outputs")):
            for tool_call in as_list(as_dict(output).get("tool_calls")):
                names.append(as_dict(as_dict(tool_call).get("function")).get("name"))
    return list(dict.fromkeys(n[:256] for n in names if isinstance(n, str) and n))


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query that cannot be a syntax error: every word, and every
    "quoted phrase", a string (all must match); a word ending in `*` matches as a prefix."""
    parts = []
    for phrase, word in re.findall(r'"([^"]*)"?|(\S+)', text):
        token = phrase or word
        prefix = bool(word) and word.endswith("*")
        token = token.rstrip("*") if prefix else token
        if not re.search(r"\w", token):
            continue  # nothing FTS5 would index: punctuation only
        quoted = '"' + token.replace('"', '""') + '"'
        parts.append(quoted + (" *" if prefix else ""))
    return " AND ".join(parts)


class TextIndex:
    """The FTS5 table of every trajectory a `StoreIndex` reads: attach it before the index's
    first refresh (`attach` reads the stores again otherwise). Thread-safe."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="trace-proxy-ui-", dir=directory))
        self.path = self.directory / "search.sqlite"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._runs: dict[tuple[int, str, str], int] = {}
        self._rows: list[tuple[int, int, str, int, int, str, str, str, str, str]] = []
        self._next_doc = 1
        with self._lock:
            for statement in (
                "PRAGMA journal_mode=OFF",  # a cache: rebuilt at every start, never recovered
                "PRAGMA synchronous=OFF",
                "CREATE VIRTUAL TABLE docs USING fts5(prompt, response, tools, errors, "
                "tokenize='unicode61 remove_diacritics 2')",
                "CREATE TABLE meta (doc INTEGER PRIMARY KEY, run INTEGER, id TEXT, "
                "ambiguous INTEGER, late INTEGER, tool_names TEXT)",
                "CREATE INDEX meta_run_id ON meta (run, id)",
            ):
                self._db.execute(statement)

    def attach(self, index: StoreIndex) -> None:
        """Follow `index` from now on; what it read already is read again to be indexed."""
        with index.lock:
            index.followers.append(self)
            if index.runs:
                for run in index.runs.values():
                    run.clear()
                index.generation += 1

    def close(self) -> None:
        with self._lock:
            self._db.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- filled by StoreIndex.refresh (its Follower) -------------------------------------------

    def added(self, run: Run, entry: Entry, record: dict[str, Any]) -> None:
        text = searchable(record)
        marks = marks_of(record)
        names = "".join(f"\n{n}" for n in tool_names(record)) + "\n"
        self._rows.append((self._next_doc, self._run_number(run), entry.id,
                           marks.ambiguous, marks.late, names,
                           *(text[c] for c in COLUMNS)))  # type: ignore[arg-type]  # fmt: skip
        self._next_doc += 1
        if len(self._rows) >= BATCH:
            self.caught_up()

    def cleared(self, run: Run) -> None:
        self.caught_up()
        number = self._run_number(run)
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM docs WHERE rowid IN (SELECT doc FROM meta WHERE run = ?)", (number,)
            )
            self._db.execute("DELETE FROM meta WHERE run = ?", (number,))
            self._db.execute("COMMIT")

    def caught_up(self) -> None:
        """Write the rows buffered so far, in one transaction."""
        rows, self._rows = self._rows, []
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT INTO meta VALUES (?, ?, ?, ?, ?, ?)", (r[:6] for r in rows)
            )
            self._db.executemany(
                "INSERT INTO docs (rowid, prompt, response, tools, errors) VALUES (?, ?, ?, ?, ?)",
                ((r[0], *r[6:]) for r in rows),
            )
            self._db.execute("COMMIT")

    def _run_number(self, run: Run) -> int:
        return self._runs.setdefault(run.ref, len(self._runs) + 1)

    # --- queries ---------------------------------------------------------------------------

    def find(
        self,
        run: Run,
        match: str | None,
        *,
        ambiguous: bool = False,
        late: bool = False,
        tool: str | None = None,
    ) -> Iterator[Hit]:
        """The run's records that match (`match`: an FTS5 query, or None for any text) and
        carry the marks asked for. Raises QueryError when FTS5 refuses `match`."""
        where: list[str] = ["meta.run = ?"]
        args: list[Any] = [self._runs.get(run.ref, 0)]
        if ambiguous:
            where.append("meta.ambiguous")
        if late:
            where.append("meta.late")
        if tool:
            where.append("instr(meta.tool_names, ?) > 0")
            args.append(f"\n{tool}\n")
        sql = "SELECT meta.doc, meta.id, meta.ambiguous, meta.late FROM "
        if match is not None:
            # CROSS JOIN keeps the full-text match outside: SQLite would otherwise run it once
            # for each of the run's rows.
            sql += "docs CROSS JOIN meta ON meta.doc = docs.rowid WHERE docs MATCH ? AND "
            args.insert(0, match)
        else:
            sql += "meta WHERE "
        sql += " AND ".join(where)
        with self._lock:
            try:
                rows = self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                raise QueryError(str(exc)) from None
        return map(Hit._make, rows)

    def marks(self, run: Run, ids: Iterable[str]) -> dict[str, tuple[int, Marks]]:
        """Each named record's document number and marks."""
        wanted = list(ids)
        found: dict[str, tuple[int, Marks]] = {}
        number = self._runs.get(run.ref, 0)
        with self._lock:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                rows = self._db.execute(
                    "SELECT id, doc, ambiguous, late FROM meta WHERE run = ? AND id IN "
                    f"({', '.join('?' * len(chunk))})",
                    [number, *chunk],
                ).fetchall()
                for ident, doc, is_ambiguous, is_late in rows:
                    found.setdefault(ident, (doc, Marks(bool(is_ambiguous), bool(is_late))))
        return found

    def snippets(self, match: str, docs: Sequence[int]) -> dict[int, tuple[str, str]]:
        """For each document that matches, the first column holding a hit and its snippet,
        the hits between HIT_START and HIT_END."""
        if not docs:
            return {}
        columns = ", ".join(
            f"snippet(docs, {n}, '{HIT_START}', '{HIT_END}', '…', {SNIPPET_TOKENS})"
            for n in range(len(COLUMNS))
        )
        sql = (f"SELECT rowid, {columns} FROM docs WHERE docs MATCH ? AND rowid IN "
               f"({', '.join('?' * len(docs))})")  # fmt: skip
        found: dict[int, tuple[str, str]] = {}
        with self._lock:
            try:
                rows = self._db.execute(sql, [match, *docs]).fetchall()
            except sqlite3.OperationalError as exc:
                raise QueryError(str(exc)) from None
        for doc, *texts in rows:
            for name, text in zip(COLUMNS, texts, strict=True):
                if HIT_START in text:
                    found[doc] = (name, text)
                    break
        return found


def highlighted(snippet: str) -> list[tuple[str, bool]]:
    """A snippet as pieces of text, each saying whether it is a hit (for a template to mark,
    escaped like any text)."""
    pieces: list[tuple[str, bool]] = []
    for n, part in enumerate(snippet.split(HIT_START)):
        hit, _, rest = part.partition(HIT_END) if n else ("", "", part)
        if hit:
            pieces.append((hit, True))
        if rest:
            pieces.append((rest, False))
    return pieces


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return " ".join(_text(as_dict(p).get("text")) for p in as_list(content))


def _tool_calls_text(calls: Any) -> list[str]:
    found = []
    for call in as_list(calls):
        function = as_dict(as_dict(call).get("function"))
        found += [_text(function.get("name")), _text(function.get("arguments"))]
    return found


def _error_text(error: Any) -> list[str]:
    if isinstance(error, dict):
        return [_text(error.get("type")), _text(error.get("message"))]
    return [_text(error)]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return str(value)[:PIECE_CAP]


def _capped(pieces: list[str]) -> str:
    kept: list[str] = []
    room = COLUMN_CAP
    for piece in pieces:
        if room <= 0:
            break
        if piece:
            piece = piece[: min(PIECE_CAP, room)]
            kept.append(piece)
            room -= len(piece) + 1
    return "\n".join(kept).replace(HIT_START, " ").replace(HIT_END, " ")
