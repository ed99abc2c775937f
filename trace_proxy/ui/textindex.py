"""The viewer's full-text index: a trajectory's words in an SQLite FTS5 table on disk.

Searching 100,000 records by reading each again reads the whole store (about 1 GB of the demo's
trajectories) at every search; keeping their text in memory takes gigabytes. So as `StoreIndex`
reads a trajectory's line it hands the record here (`added`), and its searchable text goes into
an FTS5 table in a file of the viewer's own (a temporary directory, or one `--index-dir` names;
never the store, which the viewer only reads), removed when the viewer stops. A query gives
document numbers, each the place of its entry in a list; what changes later (a late reward) is
read from the in-memory entries, so nothing is written twice.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_proxy.ui.index import Entry, Run, StoreIndex, as_dict, as_list

PIECE_CAP = 2_000  # characters of one message, response, argument or error
COLUMN_CAP = 8_000  # characters of one column of one trajectory
COLUMNS = ("prompt", "response", "tools", "errors")
BATCH = 500  # rows buffered before they are written: at most 16 million characters
HIT_START, HIT_END = "\x02", "\x03"  # around a hit in a snippet; removed from indexed text
SNIPPET_TOKENS = 16


class QueryError(ValueError):
    """A query FTS5 refused (raw syntax): its message is for the user."""


class SearchUnavailable(RuntimeError):
    """The index cannot be made here (no FTS5 in this Python's SQLite, a directory not
    writable): its message is for the user."""


@dataclass(frozen=True, slots=True)
class Marks:
    """What a search filters on that the in-memory entry does not hold."""

    ambiguous: bool
    late: bool


@dataclass(slots=True)
class Document:
    """What the index keeps of one record: its text by column (capped), marks and tool names."""

    prompt: list[str] = field(default_factory=list)
    response: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tool_names: dict[str, None] = field(default_factory=dict)  # in order, once each
    marks: Marks = Marks(False, False)

    def texts(self) -> tuple[str, str, str, str]:
        return (_capped(self.prompt), _capped(self.response), _capped(self.tools),
                _capped(self.errors))  # fmt: skip

    def names_text(self) -> str:
        """The tool names, each between newlines (found whole with `instr`)."""
        return "".join(f"\n{name}" for name in self.tool_names) + "\n"

    def add_tool_calls(self, calls: Any) -> None:
        if not isinstance(calls, list):
            return
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                self.add_tool(function.get("name"), function.get("arguments"))

    def add_tool(self, name: Any, arguments: Any, result: Any = None) -> None:
        if isinstance(name, str) and name:
            self.tool_names[name[:256]] = None
        self.tools += [_text(v) for v in (name, arguments, result) if v is not None]

    def add_error(self, error: Any) -> None:
        if isinstance(error, dict):
            self.errors += [_text(error.get("type")), _text(error.get("message"))]
        elif error is not None:
            self.errors.append(_text(error))


def document_of(record: dict[str, Any]) -> Document:
    """A record's searchable text and marks, read once (see the module's docstring)."""
    found = Document()
    for call in as_list(record.get("calls")):
        if not isinstance(call, dict):
            continue
        prompt = as_dict(call.get("prompt"))
        before = len(found.prompt)
        for message in as_list(prompt.get("messages")):
            if isinstance(message, dict):
                found.prompt.append(_message_text(message))
                found.add_tool_calls(message.get("tool_calls"))
        if isinstance(prompt.get("text"), str):
            found.prompt.append(prompt["text"])
        if len(found.prompt) == before and isinstance(call.get("prompt_text"), str):
            found.prompt.append(call["prompt_text"])  # a token prompt: its decoded text
        for output in as_list(call.get("outputs")):
            if not isinstance(output, dict):
                continue
            text = output.get("text")
            if not isinstance(text, str):
                text = output.get("response_text")  # a token output: its decoded text
            if isinstance(text, str):
                found.response.append(text)
            if isinstance(output.get("reasoning"), str):
                found.response.append(output["reasoning"])
            found.add_tool_calls(output.get("tool_calls"))
        found.add_error(call.get("error"))
        found.add_error(call.get("unparsed"))
    for tool in as_list(record.get("tools")):
        if isinstance(tool, dict):
            found.add_tool(tool.get("name"), tool.get("arguments"), tool.get("result"))
            found.add_error(tool.get("error"))
    sources = as_dict(as_dict(record.get("key")).get("sources"))
    ambiguous = any(isinstance(v, str) and "ambiguous" in v for v in sources.values())
    late = any(
        isinstance(a, dict) and a.get("field") == "step" and a.get("source") == "sampler"
        for a in as_list(record.get("annotations"))
    )
    found.marks = Marks(ambiguous, late)
    return found


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query that cannot be a syntax error: every word, and every
    "quoted phrase", a string (all must match); a word ending in `*` matches as a prefix."""
    parts = []
    text = re.sub(r"[\x00-\x1f\x7f]", " ", text)  # FTS5 ends a string at a NUL
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
    first refresh (`attach` reads the stores again otherwise). Filled and queried with the
    store index's lock held; its own lock guards the connection."""

    def __init__(self, directory: str | Path | None = None) -> None:
        try:
            self.directory = Path(tempfile.mkdtemp(prefix="trace-proxy-ui-", dir=directory))
        except OSError as exc:
            raise SearchUnavailable(f"cannot make the search's index in {directory}: "
                                    f"{exc.strerror or exc}") from None  # fmt: skip
        self.path = self.directory / "search.sqlite"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._runs: dict[tuple[int, str, str], int] = {}
        self._rows: list[tuple[int, int, str, int, int, str, str, str, str, str]] = []
        # Each document's entry (its number is its place): a match becomes an entry without
        # an id crossing from SQLite, 8 bytes per trajectory.
        self._entries: list[Entry | None] = [None]
        self._followed: StoreIndex | None = None
        for statement in (
            "PRAGMA journal_mode=OFF",  # a cache: rebuilt at every start, never recovered
            "PRAGMA synchronous=OFF",
            "CREATE VIRTUAL TABLE docs USING fts5(prompt, response, tools, errors, "
            "tokenize='unicode61 remove_diacritics 2')",
            "CREATE TABLE meta (doc INTEGER PRIMARY KEY, run INTEGER, id TEXT, "
            "ambiguous INTEGER, late INTEGER, tool_names TEXT)",
            "CREATE INDEX meta_run_id ON meta (run, id)",
        ):
            try:
                self._db.execute(statement)
            except sqlite3.OperationalError as exc:
                self.close()
                version = sqlite3.sqlite_version
                raise SearchUnavailable(
                    f"the search's index (SQLite {version} with FTS5) cannot be made: {exc}"
                ) from None

    def attach(self, index: StoreIndex) -> None:
        """Follow `index` from now on; what it read already is read again, now, to be indexed."""
        with index.lock:
            self._followed = index
            index.followers.append(self)
            if index.runs:
                for run in index.runs.values():
                    run.clear()
                    for follower in index.followers:
                        follower.cleared(run)
                index.refresh(force=True)

    def close(self) -> None:
        """Stop following and remove the index's directory (after a refresh under way)."""
        index = self._followed
        if index is not None:
            with index.lock:
                if self in index.followers:
                    index.followers.remove(self)
        with self._lock:
            self._db.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- filled by StoreIndex.refresh (its Follower) -------------------------------------------

    def added(self, run: Run, entry: Entry, record: dict[str, Any]) -> None:
        found = document_of(record)
        self._rows.append((len(self._entries), self._run_number(run), entry.id,
                           found.marks.ambiguous, found.marks.late, found.names_text(),
                           *found.texts()))  # fmt: skip
        self._entries.append(run.by_id.get(entry.id, entry))  # another replica's: the first
        if len(self._rows) >= BATCH:
            self.caught_up()

    def cleared(self, run: Run) -> None:
        self.caught_up()
        number = self._run_number(run)
        with self._lock:
            for (doc,) in self._db.execute("SELECT doc FROM meta WHERE run = ?", (number,)):
                self._entries[doc] = None
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
    ) -> list[tuple[int, Entry]]:
        """The run's entries whose records match (`match`: an FTS5 query, or None for any
        text) and carry the marks asked for, each once with its document, in the order they
        were read. Raises QueryError when FTS5 refuses `match`."""
        # `+meta.run`: the table read in document order, not each row looked up by the index
        where: list[str] = ["+meta.run = ?"]
        args: list[Any] = [self._runs.get(run.ref, 0)]
        if ambiguous:
            where.append("meta.ambiguous")
        if late:
            where.append("meta.late")
        if tool:
            where.append("instr(meta.tool_names, ?) > 0")
            args.append(f"\n{tool}\n")
        if match is not None:
            # CROSS JOIN keeps the full-text match outside: SQLite would otherwise run it once
            # for each of the run's rows.
            sql = "SELECT meta.doc FROM docs CROSS JOIN meta ON meta.doc = docs.rowid WHERE "
            where.insert(0, "docs MATCH ?")
            args.insert(0, match)
            order = "docs.rowid"
        else:
            sql, order = "SELECT meta.doc FROM meta WHERE ", "meta.doc"
        sql += " AND ".join(where) + f" ORDER BY {order}"
        with self._lock:
            try:
                rows = self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                raise QueryError(str(exc)) from None
        entries = self._entries
        # Several documents of one entry (replicas' parts of it, a line written twice): once.
        found = {id(e): (doc, e) for (doc,) in rows if (e := entries[doc]) is not None}
        return list(found.values())

    def marks_of_docs(self, docs: Sequence[int]) -> dict[int, Marks]:
        """The marks of each document named."""
        found: dict[int, Marks] = {}
        with self._lock:
            for start in range(0, len(docs), 500):
                chunk = docs[start : start + 500]
                rows = self._db.execute(
                    "SELECT doc, ambiguous, late FROM meta WHERE doc IN "
                    f"({', '.join('?' * len(chunk))})",
                    chunk,
                ).fetchall()
                for doc, is_ambiguous, is_late in rows:
                    found[doc] = Marks(bool(is_ambiguous), bool(is_late))
        return found

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
