"""Searching a run over HTTP: text in prompts, responses, tools and errors, through the full-text
index; reward, status, marks and steps as filters; late rewards and a growing store followed;
hostile queries answered with a message, every record string escaped."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp.test_utils import TestClient, TestServer
from support.stores import annotation, append, call, run_dir, step_file, trajectory

from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import Viewer, index_dir_problem, run_ui
from trace_proxy.ui.textindex import TextIndex

BASE = "/run/0/proj/exp"
EVIL = '<script>alert("x")</script>'


def chat_call(index: int, user: str, response: str) -> dict[str, Any]:
    made = call(index, response)
    made["dialect"], made["route"] = "openai.chat", "/v1/chat/completions"
    parts = [{"type": "text", "text": user}]
    made["prompt"]["messages"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": parts},
    ]
    return made


def build(store: Path) -> dict[str, dict[str, Any]]:
    """One record per thing a search must find, over two training steps and a validation one."""
    directory = run_dir(store)
    errored = call(0, "partial")
    errored["error"] = {"type": "http_500", "message": "upstream exploded badly"}
    ambiguous = trajectory(sample=4, reward=0.25, calls=[call(0, "plain answer")])
    ambiguous["key"]["sources"] = {"trajectory_id": "inferred:ambiguous"}
    late = trajectory(step=2, sample=1, reward=0.75, calls=[call(0, "slow answer")])
    late["annotations"] = [{"field": "step", "source": "sampler", "value": "2",
                            "note": "late: closed after its step ended"}]  # fmt: skip
    tool = {"index": 0, "kind": "tool", "observed": "chat_tool_calls", "start": 100.6,
            "end": 100.9, "name": "lookup_wombat", "call_id": "c1",
            "arguments": '{"city": "Reykjavik"}', "result": "cold", "requested_by": 0,
            "error": None}  # fmt: skip
    records = {
        "prompt": trajectory(sample=0, reward=0.0, calls=[call(
            0, "fine", prompt_text="<|im_start|>user\nHow many zephyrs?<|im_end|>")]),
        "chat": trajectory(sample=1, reward=1.0,
                           calls=[chat_call(0, "Name a marsupial", "a quokka, surely")]),
        "tool": trajectory(sample=2, reward=0.5, calls=[call(0, "calling")], tools=[tool]),
        "error": trajectory(sample=3, reward=None, status="error", calls=[errored]),
        "ambiguous": ambiguous,
        "late": late,
        "validation": trajectory(step=1, sample=0, validate=True, reward=1.0,
                                 calls=[call(0, f"validated quokka {EVIL}")]),
    }  # fmt: skip
    append(step_file(directory, 1), *(records[k] for k in ("prompt", "chat", "tool", "error",
                                                            "ambiguous")))  # fmt: skip
    append(step_file(directory, 2), records["late"])
    append(step_file(directory, 1, validate=True), records["validation"])
    return records


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[TestClient, Path, dict[str, Any]]]:
    store = tmp_path / "store"
    records = build(store)
    viewer = Viewer(StoreIndex([store], min_interval=0))
    client = TestClient(TestServer(viewer.app()))
    await client.start_server()
    try:
        yield client, store, records
    finally:
        await client.close()


async def found(client: TestClient, expect: int = 200, **params: str) -> tuple[list[str], str]:
    """The trajectory ids a search lists (from its result links), and the page."""
    response = await client.get(f"{BASE}/search?{urlencode(params)}")
    page = await response.text()
    assert response.status == expect, page[:2000]
    assert "<script>alert" not in page  # every record string escaped
    links = re.findall(r'class="result-link" href="/run/0/proj/exp/t/([^"]+)"', page)
    return links, page


def ids(records: dict[str, Any], *names: str) -> list[str]:
    return sorted(records[n]["id"] for n in names)


async def test_text_is_found_in_prompts_responses_tools_and_errors(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, _, records = served
    for query, expected, column in [
        ("zephyrs", ["prompt"], "prompt"),  # decoded prompt text of a token call
        ("marsupial", ["chat"], "prompt"),  # a chat message's content parts
        ("QUOKKA", ["chat", "validation"], "response"),  # any case, every step and split
        ("lookup_wombat", ["tool"], "tools"),  # a tool's name
        ("Reykjavik", ["tool"], "tools"),  # its arguments
        ("exploded badly", ["error"], "errors"),  # a call's error message
        ('"badly exploded"', [], None),  # a phrase keeps its order
        ("expl*", ["error"], "errors"),  # a prefix
    ]:
        links, page = await found(client, q=query)
        assert sorted(links) == ids(records, *expected), query
        noun = "trajectory" if len(expected) == 1 else "trajectories"
        assert f"{len(expected)} {noun} found" in page
        if column:
            assert f'<span class="muted">{column}:</span>' in page, query
            word = query.strip('"*').split()[0].lower()
            marked = [m.lower() for m in re.findall(r"<mark>([^<]*)</mark>", page)]
            assert any(m.startswith(word[:4]) for m in marked), (query, marked)
    # The record's markup reaches the snippet escaped, beside the mark.
    _, page = await found(client, q="validated")
    assert "<mark>validated</mark>" in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page


async def test_a_step_page_searches_every_step_with_its_words(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    """The step page's text filter reads that step's records; its link takes the same words to
    the whole run's search."""
    client, _, records = served
    page = await (await client.get(f"{BASE}/step/1?q=QUOKKA")).text()
    [link] = re.findall(r'id="search-run" href="([^"]+)"', page)
    assert link == f"{BASE}/search?q=QUOKKA"
    links, _ = await found(client, q="QUOKKA")
    assert sorted(links) == ids(records, "chat", "validation")  # beyond step 1


async def test_filters_find_rewards_status_marks_steps_and_tools(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, _, records = served
    for params, expected in [
        ({"min_reward": "0.5"}, ["chat", "tool", "late", "validation"]),
        ({"min_reward": "0.2", "max_reward": "0.6"}, ["tool", "ambiguous"]),
        ({"max_reward": "0"}, ["prompt"]),  # a trajectory without a reward is not 0
        ({"status": "error"}, ["error"]),
        ({"errors": "1"}, ["error"]),
        ({"ambiguous": "1"}, ["ambiguous"]),
        ({"late": "1"}, ["late"]),
        ({"min_step": "2"}, ["late"]),
        ({"max_step": "1", "split": "training"}, ["prompt", "chat", "tool", "error", "ambiguous"]),
        ({"split": "validation"}, ["validation"]),
        ({"tool": "lookup_wombat"}, ["tool"]),
        ({"tool": "lookup"}, []),  # a tool's whole name
        ({"q": "quokka", "split": "training"}, ["chat"]),  # text and filters together
        ({"q": "answer", "ambiguous": "1"}, ["ambiguous"]),
        ({"q": "answer", "min_reward": "0.5"}, ["late"]),
    ]:
        links, _ = await found(client, **params)
        assert sorted(links) == ids(records, *expected), params
    links, page = await found(client, late="1")
    assert '<span class="tag" title="closed after its step ended">late</span>' in page
    _, page = await found(client)  # the empty form lists nothing
    assert 'id="search-count"' not in page


async def test_a_late_reward_changes_what_a_reward_search_finds(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, store, records = served
    target = records["prompt"]["id"]
    assert target not in (await found(client, min_reward="0.9"))[0]
    assert (await found(client, late_reward="1"))[0] == []
    append(step_file(run_dir(store), 1), annotation([target], 1.0))
    links, _ = await found(client, min_reward="0.9")
    assert target in links
    assert (await found(client, late_reward="1"))[0] == [target]
    assert target not in (await found(client, max_reward="0"))[0]


async def test_a_growing_store_is_searched_as_it_grows(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, store, records = served
    assert (await found(client, q="platypus"))[0] == []
    newer = trajectory(step=3, sample=0, reward=0.1, calls=[call(0, "a platypus appears")])
    append(step_file(run_dir(store), 3), newer)
    assert (await found(client, q="platypus"))[0] == [newer["id"]]
    # A file cut back is read again from its start: what it no longer holds is not found.
    step_one = step_file(run_dir(store), 1)
    step_one.write_bytes(b"")
    append(step_one, records["chat"])
    assert (await found(client, q="zephyrs"))[0] == []
    assert (await found(client, q="quokka", split="training"))[0] == [records["chat"]["id"]]


QUOKKAS = ("chat", "validation")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ('"', None), ('""', None), ("*", None),  # no word: a message, not a search
        ("NEAR(", ()), ("a OR", ()), ("prompt:quokka", ()), ("quokka AND", ()),
        ("(quokka", QUOKKAS), ("^quokka", QUOKKAS), ("-quokka", QUOKKAS),
        ("quokka\u0301", QUOKKAS), ("\x00quokka", QUOKKAS), ("QUOKKA*", QUOKKAS),
        (EVIL, ("validation",)), ("'; DROP TABLE meta; --", ()), ("x" * 5000, ()),
    ],
)  # fmt: skip
async def test_hostile_queries_are_words_and_never_fail(
    served: tuple[TestClient, Path, dict[str, Any]], query: str, expected: tuple[str, ...] | None
) -> None:
    """What FTS5 would read as syntax is searched as the words it holds."""
    client, _, records = served
    links, page = await found(client, 400 if expected is None else 200, q=query)
    if expected is None:
        assert "no words to search for" in page
    else:
        assert sorted(links) == ids(records, *expected)
    # The index survived: it still answers.
    assert sorted((await found(client, q="quokka"))[0]) == ids(records, *QUOKKAS)


async def test_fts_syntax_is_there_when_asked_and_its_errors_are_messages(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, _, records = served
    links, _ = await found(client, q="quokka OR zephyrs", fts="1")
    assert sorted(links) == ids(records, "chat", "validation", "prompt")
    links, _ = await found(client, q="response: quokka NOT validated", fts="1")
    assert links == ids(records, "chat")
    for bad in ["NEAR(", "quokka AND", '"', "nocolumn: x"]:
        _, page = await found(client, expect=400, q=bad, fts="1")
        assert "the search could not be run" in page, bad
    _, page = await found(client, expect=400, min_reward="lots")
    assert "min_reward is not a number" in page
    _, page = await found(client, expect=400, q="!!! ...")
    assert "no words to search for" in page


async def test_results_come_a_page_at_a_time(tmp_path: Path) -> None:
    store = tmp_path / "store"
    directory = run_dir(store)
    many = [trajectory(sample=n, rollout=0, reward=n / 100, calls=[call(0, f"numbat {n}")])
            for n in range(73)]  # fmt: skip
    append(step_file(directory, 1), *many)
    viewer = Viewer(StoreIndex([store], min_interval=0))
    async with TestClient(TestServer(viewer.app())) as client:
        first, page = await found(client, q="numbat")
        assert "73 trajectories found; page 1 of 2" in page and len(first) == 50
        assert 'id="next-page"' in page
        second, _ = await found(client, q="numbat", page="2")
        assert len(second) == 23 and not set(first) & set(second)
        assert sorted(first + second) == sorted(r["id"] for r in many)
        beyond, _ = await found(client, q="numbat", page="9")  # the last page
        assert beyond == second


async def test_the_index_lives_outside_the_store_and_goes_with_the_viewer(
    served: tuple[TestClient, Path, dict[str, Any]], tmp_path: Path
) -> None:
    client, store, _ = served
    before = sorted(os.walk(store))
    await found(client, q="quokka")
    assert sorted(os.walk(store)) == before  # nothing written into the store
    text = TextIndex(tmp_path)
    assert text.path.is_file() and text.directory.parent == tmp_path
    text.close()
    assert not text.directory.exists()
    assert index_dir_problem(str(store / "proj"), [str(store)])
    assert index_dir_problem(str(tmp_path / "missing"), [str(store)])
    assert index_dir_problem(str(tmp_path), [str(store)]) is None
    assert run_ui([str(store)], "127.0.0.1", 0, index_dir=str(store)) == 2


async def test_the_run_page_has_the_search_form(
    served: tuple[TestClient, Path, dict[str, Any]],
) -> None:
    client, _, _ = served
    page = await (await client.get(f"{BASE}/")).text()
    assert 'action="/run/0/proj/exp/search"' in page and 'name="q"' in page


async def test_an_index_read_before_the_viewer_is_searchable(tmp_path: Path) -> None:
    store = tmp_path / "store"
    records = build(store)
    index = StoreIndex([store], min_interval=3600)  # refreshed once, unless forced
    index.refresh(force=True)
    viewer = Viewer(index)  # its full-text index reads the stores again at once
    async with TestClient(TestServer(viewer.app())) as client:
        assert sorted((await found(client, q="quokka"))[0]) == ids(records, "chat", "validation")
        assert (await found(client, min_step="2"))[0] == [records["late"]["id"]]
    assert not viewer.text.directory.exists()  # removed with the app


async def test_a_trajectory_two_replicas_wrote_is_found_once_by_either_part(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    parts = []
    for replica, word in (("a", "wombat"), ("b", "numbat")):
        record = trajectory(sample=0, reward=1.0, calls=[call(0, f"the {word} digs")])
        record["key"]["trajectory_id"] = "shared-1"
        append(step_file(run_dir(store / "replicas" / replica), 1), record)
        parts.append(record["id"])
    viewer = Viewer(StoreIndex([store], min_interval=0))
    async with TestClient(TestServer(viewer.app())) as client:
        await found(client, q="digs")  # the stores read
        run = viewer.index.run((0, "proj", "exp"))
        assert run is not None and len(run.steps[(False, 1)].entries) == 1
        shown = run.by_id[parts[0]].id  # the entry both parts are shown as
        assert run.by_id[parts[1]].id == shown
        for query in ("wombat", "numbat", "digs"):
            links, page = await found(client, q=query)
            assert links == [shown], query
            assert "1 trajectory found" in page
