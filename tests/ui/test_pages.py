"""The viewer's pages over HTTP: hostile text is only ever escaped, URLs cannot reach outside
the stores, and only the viewer's own address is answered."""

from __future__ import annotations

import html
import pkgutil
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support import version_workload
from support.proxies import running_proxy, trajectories
from support.stores import annotation, append, call, run_dir, step_file, trajectory

from trace_proxy.store.names import store_name
from trace_proxy.ui import pages, views
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import PAGES, Viewer, is_loopback

EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'
EVIL_PROJECT = f"p{EVIL}"
EVIL_EXPERIMENT = "../../etc"


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[tuple[TestClient, dict[str, str], str]]:
    """A store whose every recorded string is markup, served by the viewer."""
    store = tmp_path / "store"
    directory = run_dir(store, EVIL_PROJECT, EVIL_EXPERIMENT)
    tool_call = {"id": EVIL, "type": "function", "function": {"name": EVIL, "arguments": EVIL}}
    calls = [
        call(0, EVIL, prompt_text=f"<|im_start|>user\n{EVIL}<|im_end|>", tool_calls=[tool_call],
             logprobs=[-0.1, -2.0, -0.5]),
        call(1, f"{EVIL} bye", prompt_ids=[6, 7], prefix_call=0, prefix_len=8,
             prompt_text=EVIL),
    ]  # fmt: skip
    calls[0]["drift"] = {
        "prefix": {"at": 6, "in": EVIL, "expected": 8, "got": 3, "expected_text": EVIL,
                   "got_text": EVIL},
        "roundtrip": {"output": 0, "at": EVIL, "expected": EVIL, "got": None,
                      "expected_text": EVIL, "got_text": None},
    }  # fmt: skip
    calls[1]["error"] = {"type": EVIL, "message": EVIL}
    calls[1]["model"] = EVIL
    tools = [{"index": 0, "kind": "tool", "observed": EVIL, "start": 100.6, "end": 100.9,
              "name": EVIL, "call_id": EVIL, "arguments": EVIL, "result": EVIL,
              "requested_by": 0, "error": {"type": EVIL}}]  # fmt: skip
    first = trajectory(project=EVIL_PROJECT, experiment=EVIL_EXPERIMENT, calls=calls,
                       tools=tools, labels={EVIL: EVIL}, reward=0.0, status="error")  # fmt: skip
    first["close_reason"] = EVIL
    first["annotations"] = [{"field": EVIL, "value": EVIL}]
    second = trajectory(project=EVIL_PROJECT, experiment=EVIL_EXPERIMENT, rollout=1,
                        calls=[call(0, "fine")], reward=1.0)  # fmt: skip
    append(step_file(directory, 1), first, second, annotation([second["id"]], 0.5,
                                                              labels={EVIL: 1}))  # fmt: skip
    viewer = Viewer(StoreIndex([store], min_interval=0))
    client = TestClient(TestServer(viewer.app()))
    await client.start_server()
    project, experiment = store_name(EVIL_PROJECT), store_name(EVIL_EXPERIMENT)
    base = f"/run/0/{quote(project, safe='')}/{quote(experiment, safe='')}"
    ids = {"first": first["id"], "second": second["id"]}
    try:
        yield client, ids, base
    finally:
        await client.close()


def assert_escaped(page: str) -> None:
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(" in page or "%3Cscript%3E" in page
    # The page's only script is the viewer's own, loaded by URL.
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/static/viewer.js" defer>']


async def test_every_page_escapes_what_records_hold(
    hostile: tuple[TestClient, dict[str, str], str],
) -> None:
    client, ids, base = hostile
    pages = [
        "/", base + "/", base + "/step/1", base + f"/step/1?q={quote(EVIL)}&status=error",
        base + f"/t/{ids['first']}", base + f"/t/{ids['second']}",
        base + f"/compare?id={ids['first']}&id={ids['second']}", base + "/drift",
    ]  # fmt: skip
    for page in pages:
        response = await client.get(page)
        assert response.status == 200, page
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]
        text = await response.text()
        assert_escaped(text)
    trajectory_page = await (await client.get(base + f"/t/{ids['first']}")).text()
    assert '<span class="special">&lt;|im_start|&gt;</span>' in trajectory_page
    assert 'title="token 8 · logprob -2' in trajectory_page  # logprobs on hover
    raw = await client.get(base + f"/t/{ids['first']}/raw")
    assert raw.content_type == "application/json" and raw.headers["X-Content-Type-Options"]
    assert (await raw.json())["labels"] == {EVIL: EVIL}
    second = await (await client.get(base + f"/t/{ids['second']}")).text()
    assert "0.5" in second and "posted after the trajectory was written" in second


async def test_urls_cannot_leave_the_stores(
    hostile: tuple[TestClient, dict[str, str], str], tmp_path: Path
) -> None:
    client, _, base = hostile
    (tmp_path / "secret.jsonl").write_text('{"record": "trajectory", "id": "secret"}\n')
    for path in [
        "/static/..%2Fserver.py", "/static/viewer.py", "/static/%2E%2E/index.py",
        "/run/0/..%2F..%2F/secret.jsonl/", "/run/0/%2E%2E%2F%2E%2E/x/", "/run/1/x/y/",
        base + "/t/..%2F..%2F..%2Fsecret.jsonl", base + "/step/..%2F..%2Fsecret",
        base + "/t/secret", "/run/0/" + quote("..", safe="") + "/store/",
    ]:  # fmt: skip
        response = await client.get(path)
        assert response.status in (400, 404), path
        assert "secret" not in (await response.text()).replace(path, "")
    assert (await client.post("/", data=b"x")).status == 405


async def test_only_the_served_address_is_answered(
    hostile: tuple[TestClient, dict[str, str], str],
) -> None:
    client, _, _ = hostile
    viewer_app = client.server.app
    assert viewer_app is not None
    port = client.port
    viewer = next(m.__self__ for m in viewer_app.middlewares if hasattr(m, "__self__"))
    viewer.allowed_hosts = {f"127.0.0.1:{port}", f"localhost:{port}"}
    assert (await client.get("/", headers={"Host": "attacker.example"})).status == 421
    assert (await client.get("/", headers={"Host": f"localhost:{port}"})).status == 200
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.8.0.1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.com"))


def test_every_page_family_is_served_and_attaches_its_routes(tmp_path: Path) -> None:
    """A page family is a module of `ui/pages/` that adds its own routes: one the app left
    out would answer nothing."""
    found = {f"{pages.__name__}.{m.name}" for m in pkgutil.iter_modules(pages.__path__)}
    assert {family.__name__ for family in PAGES} == found
    viewer = Viewer(StoreIndex([tmp_path]))
    try:
        for family in PAGES:
            app = web.Application()
            family.attach(app, viewer)
            assert app.router.routes(), family.__name__
    finally:
        viewer.text.close()


async def test_step_filters_sort_and_page(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    records = [
        trajectory(step=3, sample=s, rollout=n, reward=float((s * 7 + n * 3) % 5),
                   calls=[call(0, f"answer {s}-{n}")])
        for s in range(60) for n in range(4)
    ]  # fmt: skip
    append(step_file(directory, 3), *records)
    client = TestClient(TestServer(Viewer(StoreIndex([tmp_path], min_interval=0)).app()))
    await client.start_server()
    try:
        base = "/run/0/proj/exp/step/3"
        page = await (await client.get(base)).text()
        assert page.count('class="group"') == 50 and 'id="next-page"' in page
        page = await (await client.get(base + "?page=2")).text()
        assert page.count('class="group"') == 10
        page = await (await client.get(base + "?q=answer+17-2")).text()
        assert page.count('class="group"') == 1 and page.count('class="rollout') == 1
        page = await (await client.get(base + "?min=4&sort=reward")).text()
        rewards = re.findall(r'data-reward="([^"]*)"', page)
        assert rewards and set(rewards) == {"4.0"}
        page = await (await client.get(base + "?sort=-reward")).text()
        means = [float(m) for m in re.findall(r"mean reward ([0-9.]+)", page)]
        assert means == sorted(means)
        assert (await client.get("/run/0/proj/exp/step/4")).status == 404
        assert (await client.get(base + "?split=validation")).status == 404  # none recorded
        append(step_file(directory, 3, validate=True), trajectory(step=3, validate=True))
        moved = await client.get(base + "?split=validation&q=x&page=2", allow_redirects=False)
        assert moved.status == 302
        assert moved.headers["Location"] == "/run/0/proj/exp/step/validate-3?q=x"
        page = await (await client.get(base + "?split=validation")).text()
        assert "validation step 3" in page and 'id="split"' in page
    finally:
        await client.close()


async def test_several_stores_side_by_side(tmp_path: Path) -> None:
    for name in ("a", "b"):
        append(step_file(run_dir(tmp_path / name, "proj", name), 1),
               trajectory(experiment=name, calls=[call(0, f"from store {name}")]))  # fmt: skip
    viewer = Viewer(StoreIndex([tmp_path / "a", tmp_path / "b"], min_interval=0))
    client = TestClient(TestServer(viewer.app()))
    await client.start_server()
    try:
        runs = await (await client.get("/")).text()
        assert 'href="/run/0/proj/a/"' in runs and 'href="/run/1/proj/b/"' in runs
        step = await (await client.get("/run/1/proj/b/step/1")).text()
        (ident,) = re.findall(r'data-id="([0-9a-f]+)"', step)
        page = await (await client.get(f"/run/1/proj/b/t/{ident}")).text()
        assert "from store b" in page
        assert (await client.get(f"/run/0/proj/a/t/{ident}")).status == 404
    finally:
        await client.close()


async def test_steps_of_a_run_with_validation_apart(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    for step, rewards in ((1, [0.0, 1.0]), (2, [1.0, 1.0])):
        append(
            step_file(directory, step),
            *(trajectory(step=step, rollout=n, reward=r) for n, r in enumerate(rewards)),
        )
    append(step_file(directory, 2, validate=True), trajectory(step=2, validate=True, reward=0.25))
    client = TestClient(TestServer(Viewer(StoreIndex([tmp_path], min_interval=0)).app()))
    await client.start_server()
    try:
        page = await (await client.get("/run/0/proj/exp/")).text()
        train = page[page.index('id="train-steps"') : page.index('id="validation-steps"')]
        validation = page[page.index('id="validation-steps"') :]
        assert train.count("<tr>") == 3 and validation.count("<tr>") == 2  # with the heads
        assert ">0.5<" in train and ">0.25<" in validation  # mean rewards
        assert 'href="/run/0/proj/exp/step/validate-2"' in validation
        assert page.count("<polyline") == 3 + 3  # reward, length, tools: each split
    finally:
        await client.close()


async def test_trajectory_ids_with_url_characters_open(tmp_path: Path) -> None:
    """A trajectory id is the client's (X-Rollout-Trajectory-Id): `/`, `?`, `#`, `%` and spaces
    in it are one path segment of every link, and the link opens that trajectory."""
    store = tmp_path / "store"
    odd = ["run/7?turn=2#x", "a%2Fb c", "..", "é/ü"]
    records = [trajectory(ident=ident, rollout=n, reward=float(n)) for n, ident in enumerate(odd)]
    append(step_file(run_dir(store), 1), *records)
    viewer = Viewer(StoreIndex([store], min_interval=0))
    async with TestClient(TestServer(viewer.app())) as client:
        step = await client.get("/run/0/proj/exp/step/1")
        assert step.status == 200
        links = re.findall(r'class="traj-link" href="([^"]+)"', await step.text())
        assert len(links) == len(odd)
        opened = set()
        for link in links:
            page = await client.get(html.unescape(link))
            assert page.status == 200, link
            raw = await client.get(
                html.unescape(re.findall(r'id="raw-link" href="([^"]+)"', await page.text())[0])
            )
            assert raw.status == 200
            opened.add((await raw.json())["id"])
        assert opened == set(odd)


async def test_a_group_says_what_its_sample_asks(tmp_path: Path) -> None:
    """The step page names each group's prompt: the first user message (or the decoded text of
    a token prompt), its start on the card, the whole of it one click away."""
    directory = run_dir(tmp_path)
    question = "What is the weather in Paris?\n\nAnswer in   one word. " + "Then explain. " * 30
    chat = trajectory(step=1, sample=0, calls=[call(0, "Sunny")])
    chat["calls"][0]["prompt"]["messages"] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": question}]},
    ]
    tokens = trajectory(step=1, sample=1, calls=[call(0, "4", prompt_text="Two plus two is")])
    unknown = trajectory(step=1, sample=2, calls=[call(0, "?")])
    append(step_file(directory, 1), chat, tokens, unknown)
    client = TestClient(TestServer(Viewer(StoreIndex([tmp_path], min_interval=0)).app()))
    await client.start_server()
    try:
        page = await (await client.get("/run/0/proj/exp/step/1")).text()
    finally:
        await client.close()
    summaries = re.findall(r'<details class="gprompt"><summary>(.*?)</summary>', page, re.S)
    start = " ".join(question.split())[:160]
    assert summaries == [html.escape(start) + "…", "Two plus two is"]
    full = re.findall(r'<div class="full-prompt">(.*?)</div>', page, re.S)
    assert full[0] == html.escape(question) and full[1] == "Two plus two is"
    assert page.count('class="group"') == 3  # the third, with no prompt known, has no line


async def test_a_tool_call_with_its_span_is_shown_once_with_its_result(tmp_path: Path) -> None:
    """A chat tool call that became a tool span is shown as the span (name, arguments,
    result), not a second time among the response's tool calls; one no span answered is."""
    directory = run_dir(tmp_path)
    asked = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    unanswered = {
        "id": "call-2",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
    }
    first, second = call(0, "", tool_calls=[asked, unanswered]), call(1, "Sunny, 18 C")
    first["outputs"][0]["text"] = None
    tools = [{"index": 0, "kind": "tool", "observed": "chat_tool_calls", "start": 100.5,
              "end": 101.0, "name": "get_weather", "call_id": "call-1",
              "arguments": '{"city": "Paris"}', "result": '{"temp_c": 18}', "requested_by": 0,
              "error": None}]  # fmt: skip
    record = trajectory(step=1, calls=[first, second], tools=tools, ident="a" * 32)
    sibling = trajectory(step=1, rollout=1, calls=[first, call(1, "Rainy")], tools=tools)
    append(step_file(directory, 1), record, sibling)
    client = TestClient(TestServer(Viewer(StoreIndex([tmp_path], min_interval=0)).app()))
    await client.start_server()
    try:
        pages = [
            await (await client.get(f"/run/0/proj/exp/t/{record['id']}")).text(),
            await (await client.get(
                f"/run/0/proj/exp/compare?id={record['id']}&id={sibling['id']}")).text(),
        ]  # fmt: skip
    finally:
        await client.close()
    for page, rollouts in zip(pages, (1, 2), strict=True):
        calls_shown = re.findall(r'<div class="toolcall">.*?</div>', page, re.S)
        spans = re.findall(r'<div class="toolspan">.*?</pre>\s*</div>', page, re.S)
        assert not [c for c in calls_shown if "get_weather" in c]  # shown as its span only
        assert len([c for c in calls_shown if "calculator" in c]) == rollouts  # no span: shown
        assert len(spans) == rollouts
        assert all("get_weather" in s and "temp_c" in s and "Paris" in s for s in spans)


async def test_a_replayed_trajectory_is_compared_with_the_recorded(tmp_path: Path) -> None:
    """`trace-proxy replay`'s trajectories name the recorded one in their labels: its page
    links to it and to a compare page with both side by side, the recorded first, the first
    divergence marked, and the recorded one's page links back; labels that name nothing
    served give no link, and are never a path."""
    store = tmp_path / "store"
    recorded = trajectory(ident="r" * 32, calls=[call(0, "Paris."), call(1, "Done.")])
    append(step_file(run_dir(store, "proj", "exp"), 1), recorded)
    labels = {"replay_of": recorded["id"], "replay_of_project": "proj",
              "replay_of_experiment": "exp"}  # fmt: skip
    replayed = trajectory(ident="n" * 32, experiment="exp-replay", labels=labels,
                          calls=[call(0, "Paris."), call(1, "Lyon, then done.")])  # fmt: skip
    stray = trajectory(ident="s" * 32, experiment="exp-replay", sample=1, labels={
        **labels, "replay_of_experiment": "../../../etc"})  # fmt: skip
    append(step_file(run_dir(store, "proj", "exp-replay"), 1), replayed, stray)
    viewer = Viewer(StoreIndex([store], min_interval=0))
    async with TestClient(TestServer(viewer.app())) as client:
        page = await (await client.get(f"/run/0/proj/exp-replay/t/{replayed['id']}")).text()
        link = re.findall(r'id="compare-recorded" href="([^"]+)"', page)
        assert re.findall(r'id="recorded-link" href="([^"]+)"', page) == [
            f"/run/0/proj/exp/t/{recorded['id']}"
        ]
        compare = await client.get(html.unescape(link[0]))
        assert compare.status == 200
        text = await compare.text()
        heads = re.findall(r'class="traj-link" href="([^"]+)"', text)
        assert heads == [f"/run/0/proj/exp/t/{recorded['id']}",
                         f"/run/0/proj/exp-replay/t/{replayed['id']}"]  # fmt: skip
        assert '<div class="tag recorded">recorded</div>' in text
        assert 'id="first-divergence"' in text and "turn 2" in text
        assert "Lyon, then done." in text and "Done." in text

        page = await (await client.get(f"/run/0/proj/exp/t/{recorded['id']}")).text()
        assert re.findall(r'class="compare-replay" href="([^"]+)"', page) == [link[0]]
        assert re.findall(r'class="replay-link" href="([^"]+)"', page) == [
            f"/run/0/proj/exp-replay/t/{replayed['id']}"
        ]

        for trajectory_id in (recorded["id"], stray["id"]):
            run = "exp" if trajectory_id == recorded["id"] else "exp-replay"
            page = await (await client.get(f"/run/0/proj/{run}/t/{trajectory_id}")).text()
            assert 'id="compare-recorded"' not in page
            missing = await client.get(f"/run/0/proj/{run}/compare?id={trajectory_id}&recorded=1")
            assert missing.status == 404
        two = await client.get(
            f"/run/0/proj/exp-replay/compare?id={replayed['id']}&id={stray['id']}&recorded=1"
        )
        assert two.status == 400


def test_a_decoded_and_an_undecoded_rollout_are_compared_as_sent() -> None:
    """token2text decoded one side only (a replay without a tokenizer): its decoded text is not
    set against the other's API text; what each was sent and answered is."""
    decoded = call(0, "<tool_call>x</tool_call>", prompt_text="<|im_start|>user\nHi")
    plain = call(0, "")
    plain["prompt"]["token_ids"] = None
    for one in (decoded, plain):
        one["prompt"]["messages"] = [{"role": "user", "content": "Hi"}]
        one["outputs"][0]["text"] = None
        one["outputs"][0]["tool_calls"] = [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]
    del plain["outputs"][0]["response_text"]
    same = [views.trajectory_view(trajectory(calls=[c])) for c in (decoded, plain)]
    assert views.first_divergence(same) is None
    plain["outputs"][0]["tool_calls"][0]["function"]["name"] = "g"
    differ = [views.trajectory_view(trajectory(calls=[c])) for c in (decoded, plain)]
    divergence = views.first_divergence(differ)
    assert divergence is not None
    assert (divergence.turn, divergence.where, divergence.basis) == (0, "response", "api")


async def test_an_asynchronous_run_shows_how_stale_its_samples_were(
    tmp_path: Path, qwen_tokenizer: Any
) -> None:
    """A real proxy's records of a partial rollout resumed across a weight sync and a rollout
    on one version, closed one sync later (tests/support/version_workload.py): the run page counts
    samples by versions spanned and by versions behind at close, the step page filters partial
    rollouts, and the partial rollout's timeline marks the sync between its two attempts."""
    output = tmp_path / "traces"
    async with version_workload.upstream(qwen_tokenizer) as url:
        async with running_proxy([url], output) as (_, proxy):
            async with aiohttp.ClientSession() as session:
                await version_workload.partial_rollouts(session, proxy, qwen_tokenizer)
    records = version_workload.by_sample(trajectories(output))
    key = records[0]["key"]
    client = TestClient(TestServer(Viewer(StoreIndex([output], min_interval=0)).app()))
    await client.start_server()
    try:
        base = f"/run/0/{quote(store_name(key['project']), safe='')}/{version_workload.EXPERIMENT}"
        page = await (await client.get(base + "/")).text()

        def bars(figure: str) -> dict[str, str]:
            found = re.search(rf'<figure class="plot bars" id="{figure}">(.*?)</figure>', page,
                              re.S)  # fmt: skip
            assert found, figure
            return dict(re.findall(r'data-value="([^"]+)" data-count="(\d+)"', found.group(1)))

        assert bars("version-spread") == {"0": "1", "1": "1"}  # sample 1 on 4; sample 0: 3, 4
        assert bars("version-lag") == {"0": "0", "1": "2"}  # both closed on 4 when 5 was out

        step = base + "/step/1"
        partial = await (await client.get(step + "?partial=yes")).text()
        assert re.findall(r'data-id="([^"]+)"', partial) == [records[0]["id"]]
        assert "partial · 1 sync" in partial and "1 behind at close" in partial
        whole = await (await client.get(step + "?partial=no")).text()
        assert re.findall(r'data-id="([^"]+)"', whole) == [records[1]["id"]]
        assert 'class="tag partial-tag"' not in whole

        page = await (await client.get(f"{base}/t/{records[0]['id']}")).text()
        facts = re.search(r'<dd id="traj-versions">(.*?)</dd>', page)
        assert facts and facts.group(1) == (
            "versions 3 to 4, partial rollout; newest at close 5 (1 behind)"
        )
        [(before, after, x)] = re.findall(
            r'<g class="sync" data-before="([^"]+)" data-after="([^"]+)">.*?<line x1="([\d.]+)"',
            page, re.S,
        )  # fmt: skip
        assert (before, after) == ("3", "4")
        attempts = re.findall(
            r'<g class="span segment">.*?<text[^>]*>([^<]*)</text>\s*<rect x="([\d.]+)" y="[\d.]+"'
            r' width="([\d.]+)"', page, re.S,
        )  # fmt: skip
        assert [label for label, _, _ in attempts] == ["↳ attempt 1 · v3", "↳ attempt 2 · v4"]
        (_, first_x, first_w), (_, second_x, _) = attempts
        assert float(first_x) + float(first_w) <= float(x) <= float(second_x)  # between them
    finally:
        await client.close()


def test_a_sync_between_two_calls_is_marked_once_between_them() -> None:
    """Turns on different versions: the sync lies between the turn before it and the one
    after; turns on one version, or without one, mark nothing."""
    calls = [call(n, f"turn {n}") for n in range(3)]
    for made, version in zip(calls, ("3", "3", "4"), strict=True):
        made["weight_version"] = version
    view = views.trajectory_view(trajectory(calls=calls))
    [sync] = view.syncs
    assert (sync.before, sync.after) == ("3", "4")
    earlier, later = view.spans[1], view.spans[2]
    assert earlier.end is not None and earlier.end <= sync.at <= later.start
    calls[2]["weight_version"] = None
    assert views.trajectory_view(trajectory(calls=calls)).syncs == []
