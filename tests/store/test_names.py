"""Store names: any text to one safe path component, injectively, and back; names from requests
become directory names of the store, and never a path out of it.

Every value a request controls that names a directory (project, experiment: headers, baggage,
the path prefix, body mappings, the admin port's /rewards) goes through `store_name`; these
tests send hostile ones through a real proxy and check the whole temporary tree afterwards.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import unicodedata
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from fakes import FakeVLLM
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.proxies import raw_post, running_proxy, trajectories

from trace_proxy.client import post_reward
from trace_proxy.exporters.backends.jsonl import JsonlExporter
from trace_proxy.show import show
from trace_proxy.store import layout
from trace_proxy.store.layout import NAME_FILE
from trace_proxy.store.names import (
    EMPTY,
    MARK,
    MAX_NAME,
    decode_name,
    digest,
    is_safe_component,
    store_name,
)
from trace_proxy.store.readers import iter_records, run_records
from trace_proxy.trajectories.keys import HEADER_NAMES
from trace_proxy.trajectories.record import RolloutKey, Trajectory


def tree(root: Path) -> set[Path]:
    """Every file and directory under `root` (symbolic links not followed)."""
    found = set()
    for directory, dirs, files in os.walk(root):
        found.update(Path(directory, name) for name in dirs + files)
    return found


def under(path: Path, root: Path) -> bool:
    return os.path.commonpath([path, root]) == str(root)


async def test_hostile_names_stay_under_the_output_and_every_record_is_kept(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    out = tmp_path / "a" / "b" / "c" / "out"  # `..` from here still lands in tmp_path
    outside = tmp_path / "outside"
    out.mkdir(parents=True)
    outside.mkdir()
    (out / "not-a-dir").write_text("a file of the operator's, where a project would go\n")
    nfc = unicodedata.normalize("NFC", "caf\u00e9")
    nfd = unicodedata.normalize("NFD", "caf\u00e9")
    assert nfc != nfd
    # (how the value travels, field, value)
    cases: list[tuple[str, str, str]] = [
        ("header", "experiment", "../../../x"),
        ("header", "experiment", str(outside / "abs-experiment")),
        ("header", "project", "../.."),
        ("header", "project", str(outside / "abs-project")),
        ("header", "experiment", ".."),
        ("header", "experiment", "."),
        ("header", "experiment", ".hidden"),
        ("header", "experiment", "a/b"),
        ("header", "experiment", "a\\b"),
        ("header", "experiment", "%2E%2E"),
        ("baggage", "experiment", "nul\x00byte"),
        ("baggage", "experiment", "ctl\x01\x1b\x7f"),
        ("header", "experiment", "n" * 256),
        ("baggage", "experiment", "\u00e9" * 256),
        ("baggage", "experiment", nfc),
        ("baggage", "experiment", nfd),
        ("header", "experiment", "GRPO"),
        ("header", "experiment", "grpo"),
        ("path", "experiment", "../../path-escape"),
        ("path", "project", str(outside / "path-project")),
        ("body", "experiment", "../../\x00body"),
        ("header", "project", ".spool"),
        ("header", "project", "not-a-dir"),
    ]
    before = tree(tmp_path)
    statuses = []
    async with running_proxy(
        [upstream], out, map=["header:X-Session-ID=trajectory_id", "body:user=experiment"],
        shutdown_grace=5.0,
    ) as (service, proxy):  # fmt: skip
        async with aiohttp.ClientSession() as session:
            for number, (how, field, value) in enumerate(cases):
                headers = {"X-Rollout-Trajectory-Id": f"t{number}", "X-Rollout-Step": "1",
                           "X-Rollout-Done": "true"}  # fmt: skip
                body: dict[str, Any] = {"model": "tiny-qwen", "prompt": "Hi", "max_tokens": 2}
                route = "/v1/completions"
                if how == "header":
                    headers[HEADER_NAMES[field]] = value
                elif how == "baggage":
                    headers["baggage"] = f"rollout.{field}={quote(value, safe='')}"
                elif how == "path":
                    route = f"/rollout/{field}={quote(value, safe='')}{route}"
                else:
                    body["user"] = value
                async with session.post(proxy + route, json=body, headers=headers) as response:
                    statuses.append(response.status)
            # A step number too long for a file name is malformed metadata, not a path.
            step_headers = {"X-Rollout-Trajectory-Id": "long-step", "X-Rollout-Done": "true",
                            "X-Rollout-Step": "9" * 300}  # fmt: skip
            async with session.post(
                proxy + "/v1/completions", json=body, headers=step_headers
            ) as response:
                statuses.append(response.status)
        await service.flush()
        assert service.addresses is not None and service.addresses.admin is not None
        admin = service.addresses.admin
        rewards = [
            {"trajectory_id": "t0"},  # exported: the annotation goes next to its trajectory
            {"project": "../../rewards", "experiment": str(outside / "rw"), "step": 1,
             "sample_index": 0},
            {"project": "", "experiment": "\x00" + "z" * 1000, "step": 2, "sample_index": 0},
        ]  # fmt: skip
        where = [await asyncio.to_thread(post_reward, admin, reward=0.5, **r) for r in rewards]
    assert statuses == [200] * (len(cases) + 1)
    assert where == ["exported", "unknown", "unknown"]

    created = tree(tmp_path) - before
    assert created and all(under(path, out) for path in created), sorted(
        str(p) for p in created if not under(p, out)
    )
    assert not list(outside.iterdir())
    records = list(iter_records(out))
    assert all(under(path, out) and ".spool" not in path.parts for path, _ in records)

    by_id = {t["key"]["trajectory_id"]: t for t in trajectories(out)}
    assert len(by_id) == len(cases) + 1
    files: dict[Path, set[tuple[str, str]]] = {}
    for path, record in records:
        key = record.get("key") or record
        files.setdefault(path, set()).add((key["project"], key["experiment"]))
    for number, (how, field, value) in enumerate(cases):
        record = by_id[f"t{number}"]
        key = record["key"]
        assert key[field] == value, (how, field, value)
        [path] = [p for p, r in records if r.get("id") == record["id"]]
        project_dir, experiment_dir, file_name = path.relative_to(out).parts
        assert file_name == "step-000001.jsonl"
        expected = (store_name(key["project"]), store_name(key["experiment"]))
        if value == "not-a-dir":  # that name is taken by a file: a name of its own
            expected = (f"not-a-dir~{digest('not-a-dir')}", expected[1])
        assert (project_dir, experiment_dir) == expected
        notes = [a for a in record["annotations"] if "stored_as" in a]
        renamed = store_name(value) != value
        assert notes == ([{"field": field, "source": key["sources"][field], "value": value[:256],
                           "stored_as": store_name(value)}] if renamed else [])  # fmt: skip
    # Distinct names never share a file, and one name never spreads over two directories.
    assert all(len(pairs) == 1 for pairs in files.values())
    directories: dict[tuple[str, str], set[Path]] = {}
    for path, pairs in files.items():
        [pair] = pairs
        directories.setdefault(pair, set()).add(path.parent)
    assert all(len(dirs) == 1 for dirs in directories.values())

    long_step = by_id["long-step"]
    assert long_step["key"]["step"] is None
    assert any(a.get("field") == "step" and "error" in a for a in long_step["annotations"])

    notes = [r for _, r in records if r.get("record") == "annotation"]
    assert sorted((n["project"], n["experiment"]) for n in notes) == sorted(
        [("default", "../../../x"), ("../../rewards", str(outside / "rw")),
         ("", "\x00" + "z" * 1000)]
    )  # fmt: skip
    [late] = [p for p, r in records if r.get("record") == "annotation" and r["trajectories"]]
    [first] = [p for p, r in records if r.get("id") == by_id["t0"]["id"]]
    assert late == first

    text = io.StringIO()
    assert show(out, out=text) == 0
    assert f"{len(cases) + 1} trajectories, 0 step events under {out}" in text.getvalue()
    assert "reward 0.5" in text.getvalue()  # the late reward, applied by `show`


# --- the store's directories, in process ---------------------------------------------------------


def trajectory(project: str, experiment: str, number: int = 0, step: int | None = 1) -> Trajectory:
    key = RolloutKey(project=project, experiment=experiment, step=step, sample_index=number)
    return Trajectory(id=f"{project}/{experiment}/{number}", key=key, start=1.0, end=2.0,
                      status="ok", close_reason="done", calls=[])  # fmt: skip


def stored(out: Path) -> dict[str, set[tuple[str, str]]]:
    """Each file's directory (relative to `out`), and the (project, experiment) of its records."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path, record in iter_records(out):
        key = record.get("key") or record
        found.setdefault(str(path.parent.relative_to(out)), set()).add(
            (key["project"], key["experiment"])
        )
    return found


def name_file(directory: Path) -> str:
    value: str = json.loads((directory / NAME_FILE).read_bytes())
    return value


class CaseInsensitiveOs:
    """`os` as seen on a case-insensitive, case-preserving filesystem (macOS's default) under
    `root`: a name finds the entry that differs from it only in case. Only the calls that look
    names up are translated; everything else is the real `os`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _real(self, path: Any) -> str:
        path = Path(path)
        if not under(path, self.root) or path == self.root:
            return str(path)
        real = self.root
        for part in path.relative_to(self.root).parts:
            entries = os.listdir(real) if real.is_dir() else []
            real /= next((e for e in entries if e.casefold() == part.casefold()), part)
        return str(real)

    def lstat(self, path: Any) -> os.stat_result:
        return os.lstat(self._real(path))

    def mkdir(self, path: Any, mode: int = 0o777) -> None:
        os.mkdir(self._real(path), mode)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        return os.open(self._real(path), flags, mode)

    def listdir(self, path: Any) -> list[str]:
        return os.listdir(self._real(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def test_names_differing_only_in_case_on_a_case_insensitive_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    (out / "legacy" / "Old").mkdir(parents=True)  # an earlier version's directory: no name file
    monkeypatch.setattr(layout, "os", CaseInsensitiveOs(out))
    monkeypatch.setattr(layout, "KNOWN_DIRECTORIES", 1)  # decided again and again: the same
    values = [("P", "GRPO"), ("P", "grpo"), ("P", "Grpo"), ("p", "grpo"), ("legacy", "old"),
              ("legacy", "Old")]  # fmt: skip
    for round_ in range(2):  # a second process finds the same directories
        store = JsonlExporter(out)
        store.export([trajectory(p, e, round_) for p, e in values])
        store.close()
    by_directory = stored(out)
    assert sorted(by_directory) == sorted([
        "P/GRPO", f"P/grpo~{digest('grpo')}", f"P/Grpo~{digest('Grpo')}",
        f"p~{digest('p')}/grpo", f"legacy/old~{digest('old')}", "legacy/Old",
    ])  # fmt: skip
    assert all(len(pairs) == 1 for pairs in by_directory.values())
    for directory, [(project, experiment)] in by_directory.items():
        assert name_file(out / directory) == experiment
        assert name_file((out / directory).parent) == project
    assert len(list(iter_records(out))) == 2 * len(values)
    again = JsonlExporter(out)  # a replay reads where the records are
    assert again.exported_ids([trajectory(p, e, 1) for p, e in values]) == {
        f"{p}/{e}/1" for p, e in values
    }


def test_an_earlier_versions_directories_are_kept_and_nothing_outside_is_followed(
    tmp_path: Path,
) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside"
    (out / "p" / "e").mkdir(parents=True)
    old = orjson.dumps({"record": "trajectory", "id": "old", "key": {"project": "p",
                        "experiment": "e"}}) + b"\n"  # fmt: skip
    (out / "p" / "e" / "step-000001.jsonl").write_bytes(old)
    outside.mkdir()
    (out / "linked").symlink_to(outside, target_is_directory=True)
    (out / "p" / "dangling").symlink_to(tmp_path / "nowhere")
    before = tree(outside)
    store = JsonlExporter(out)
    store.export([trajectory("p", "e"), trajectory("linked", "e"), trajectory("p", "dangling")])
    store.close()
    assert tree(outside) == before and not (tmp_path / "nowhere").exists()
    assert stored(out) == {
        "p/e": {("p", "e")},
        f"linked~{digest('linked')}/e": {("linked", "e")},
        f"p/dangling~{digest('dangling')}": {("p", "dangling")},
    }
    ids = [r["id"] for _, r in run_records(out / "p" / "e")]
    assert ids == ["old", "p/e/0"]  # the same file, taken over
    assert name_file(out / "p") == "p" and name_file(out / "p" / "e") == "e"


def test_a_replay_finds_encoded_names_and_looks_without_making_directories(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    hostile = trajectory("../..", "/etc\x00", 0)
    huge = trajectory("p", "\x00" * 300_000, 1)  # as /rewards may name one: a long name file
    store = JsonlExporter(out)
    store.export([hostile, huge])
    store.close()
    before = tree(tmp_path)
    again = JsonlExporter(out)
    unseen = [trajectory("../..", "other", 2), trajectory("new", "x", 3)]
    assert again.exported_ids([hostile, huge, *unseen]) == {hostile.id, huge.id}
    assert tree(tmp_path) == before
    assert len(stored(out)) == 2


def test_a_directory_removed_while_the_store_runs_is_made_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    store = JsonlExporter(out)
    store.export([trajectory("p", "e", 0), trajectory("p", "e", 1, step=2)])
    store.close()
    shutil.rmtree(out / "p")
    store.export([trajectory("p", "e", 2)])
    store.close()
    assert [r["id"] for _, r in iter_records(out)] == ["p/e/2"]
    assert name_file(out / "p" / "e") == "e"


@pytest.mark.parametrize("mode", ["process", "inline"])
async def test_header_bytes_that_are_not_utf8_are_recorded_and_recording_goes_on(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path, mode: str
) -> None:
    """A header value is bytes; those that are not UTF-8 reach Python as lone surrogates, which
    no JSON encoder writes: such a request went unrecorded, uncounted (capture process), or
    stopped the spool's writer and every record after it (inline). They are recorded with U+FFFD
    in place of each such byte."""
    _, upstream = fake_vllm
    body = orjson.dumps({"model": "tiny-qwen", "prompt": "Hi", "max_tokens": 2})
    async with running_proxy([upstream], tmp_path, capture_mode=mode) as (service, proxy):
        for number, head in enumerate([
            b"X-Rollout-Project: p\xff\xfe\r\nUser-Agent: caf\xe9\r\n",
            b"X-Rollout-Experiment: \xc3(\r\n",
            b"X-Rollout-Trajectory-Id: t\x80\r\n",
            b"",
        ]):  # fmt: skip
            done = b"X-Rollout-Done: true\r\nX-Rollout-Sample-Index: %d\r\n" % number
            line = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\n"
            json_type = b"Content-Type: application/json\r\n"
            assert await raw_post(proxy, line + json_type + head + done, body) == b"HTTP/1.1 200 OK"
        await asyncio.wait_for(service.flush(), 60)  # a writer stopped never flushes
    keys = sorted((t["key"]["sample_index"], t["key"]["project"], t["key"]["experiment"],
                   t["key"]["trajectory_id"]) for t in trajectories(tmp_path))  # fmt: skip
    assert [k[0] for k in keys] == [0, 1, 2, 3]
    assert keys[0][1] == "p\ufffd\ufffd" and keys[1][2] == "\ufffd(" and keys[2][3] == "t\ufffd"
    [first] = [t for t in trajectories(tmp_path) if t["key"]["sample_index"] == 0]
    assert first["calls"][0]["request_headers"]["user-agent"] == "caf\ufffd"


# Any code point, lone surrogates included (a str can hold them; the name must still exist).
ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=300)
PIECES = ["/", "\\", ".", "..", "\x00", "\x01", "%", "~", "\u00e9", "e\u0301", "a", "A", " ",
          "\ud800", "%2E", "%25"]  # fmt: skip
HOSTILE = st.lists(st.sampled_from(PIECES), max_size=80).map("".join)


def check(name: str) -> None:
    assert is_safe_component(name)
    assert name not in (".", "..") and not name.startswith(".")
    assert not any(c in name for c in "/\\\x00")
    assert name.isascii() and name.isprintable()
    assert 0 < len(name) <= MAX_NAME


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(ANY_TEXT, HOSTILE), min_size=2, max_size=6, unique=True))
@example(["", "%", "%25", "."])
@example(["..", "%2E.", ".%2E", "%2E%2E"])
@example(["GRPO", "grpo"])
@example(["x" * 150, "x" * 151, "x" * 400, "x" * 401])
@example([unicodedata.normalize("NFC", "caf\u00e9"), unicodedata.normalize("NFD", "caf\u00e9")])
def test_distinct_values_get_distinct_safe_names(values: list[str]) -> None:
    names = [store_name(v) for v in values]
    for name in names:
        check(name)
    assert len(set(names)) == len(values)
    for value, name in zip(values, names, strict=True):
        assert store_name(value) == name  # deterministic
        if MARK not in name:
            assert decode_name(name) == value
        else:
            assert decode_name(name) is None
            assert name.endswith(MARK + digest(value))


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("Qwen3-8B-grpo", "Qwen3-8B-grpo"),
        ("lr=1e-5+warmup@v2.1_x", "lr=1e-5+warmup@v2.1_x"),
        ("", EMPTY),
        (".", "%2E"),
        ("..", "%2E."),
        ("../../../x", "%2E.%2F..%2F..%2Fx"),
        ("/abs/dir", "%2Fabs%2Fdir"),
        ("a\\b", "a%5Cb"),
        ("a\x00b", "a%00b"),
        ("100%", "100%25"),
        ("a b", "a%20b"),
        ("~", "%7E"),
        (".hidden", "%2Ehidden"),
        ("caf\u00e9", "caf%C3%A9"),
        ("cafe\u0301", "cafe%CC%81"),
    ],
)
def test_names(value: str, name: str) -> None:
    assert store_name(value) == name
    assert decode_name(name) == value


def test_a_long_name_is_cut_outside_an_escape_and_ends_with_the_hash() -> None:
    for pad in range(4):
        value = "x" * pad + "\u00e9" * 200
        name = store_name(value)
        check(name)
        prefix, mark, tail = name.partition(MARK)
        assert mark and tail == digest(value)
        assert decode_name(prefix) == "x" * pad + "\u00e9" * ((len(prefix) - pad) // 6)


@pytest.mark.parametrize("name", ["a%2", "a%2e", "a%zz", "a b", "a~b", "%2E%2E/", ".", "a%2Eb"])
def test_what_store_name_does_not_produce_does_not_decode(name: str) -> None:
    assert decode_name(name) is None
