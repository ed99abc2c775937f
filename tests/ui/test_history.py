"""One prompt across steps, over HTTP: from a group (or a trajectory) to every step where the
same prompt was kept, whatever sample index it had there, with its rewards, response lengths
and the best and worst answer of each step."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from support.stores import annotation, append, call, run_dir, step_file, trajectory

from trace_proxy.ui.index import StoreIndex, prompt_hash
from trace_proxy.ui.server import Viewer

QUESTION = "What is 17 * 23 + 4?"


def chat(
    step: int, sample: int, rollout: int, answer: str, reward: float | None,
    question: str = QUESTION, *, validate: bool = False, tokens: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """A rollout of a chat sample: a system and a user message, then `answer`."""
    first = call(0, answer, output_ids=list(range(tokens)))
    first["prompt"]["token_ids"] = None
    first["prompt"]["messages"] = [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": question},
    ]
    return trajectory(step=step, sample=sample, rollout=rollout, reward=reward,
                      validate=validate, calls=[first])  # fmt: skip


def steps_of(page: str) -> list[dict[str, Any]]:
    """The history table's rows: step, rollouts, reward mean, spread, tokens, best, worst."""
    rows = []
    for row in re.findall(r'<tr class="history-step".*?</tr>', page, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        answers = [re.findall(r'<pre class="text response">(.*?)</pre>', c, re.S) for c in cells]
        rows.append({
            "step": re.sub(r"<[^>]+>", "", cells[0]).strip(),
            "rollouts": cells[1], "mean": cells[2], "spread": cells[3], "tokens": cells[4],
            "best": html.unescape(answers[5][0]) if answers[5] else None,
            "worst": html.unescape(answers[6][0]) if answers[6] else None,
        })  # fmt: skip
    return rows


async def test_a_prompt_at_every_step_where_it_was_kept(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)
    wrong, right = chat(1, 3, 0, "395", 0.0, tokens=4), chat(1, 3, 1, "395? no: 395", 1.0)
    other = chat(1, 0, 0, "4", 1.0, "What is 2 + 2?")
    later = [chat(2, 0, 0, "395", 1.0, tokens=2), chat(2, 0, 1, "395", 1.0, tokens=2)]
    held_out = chat(2, 1, 0, "400", 0.0, validate=True)
    third = [chat(3, 2, 0, "391", 0.0), chat(3, 2, 1, "395", 0.5)]
    append(step_file(directory, 1), wrong, right, other)
    append(step_file(directory, 2), *later)
    append(step_file(directory, 2, validate=True), held_out)
    append(step_file(directory, 3), *third)
    # A reward posted later changes step 3's best answer.
    append(step_file(directory, 3), annotation([third[0]["id"]], 1.0, step=3))
    digest = prompt_hash(wrong["calls"][0])
    assert digest is not None and digest != prompt_hash(other["calls"][0])

    client = TestClient(TestServer(Viewer(StoreIndex([tmp_path], min_interval=0)).app()))
    await client.start_server()
    try:
        step_page = await (await client.get("/run/0/proj/exp/step/1")).text()
        trajectory_page = await (await client.get(f"/run/0/proj/exp/t/{right['id']}")).text()
        response = await client.get(f"/run/0/proj/exp/prompt/{digest}")
        assert response.status == 200
        page = await response.text()
        missing = await client.get("/run/0/proj/exp/prompt/0123456789abcdef")
        hostile = await client.get("/run/0/proj/exp/prompt/%3Cscript%3E")
        assert (missing.status, hostile.status) == (404, 404)
        assert "<script>" not in await hostile.text()
    finally:
        await client.close()

    # The group of step 1 (sample 3) and its trajectory link to the prompt's history.
    card = r'<tr class="group" data-group="([^"]+)".*?<a class="prompt-history" href="([^"]+)">'
    links = dict(re.findall(card, step_page, re.S))
    assert links["sample 3"] == f"/run/0/proj/exp/prompt/{digest}"
    assert re.search(rf'href="/run/0/proj/exp/prompt/{digest}">asked at 4 steps', trajectory_page)
    assert "this prompt at 4 steps" in step_page and "this prompt at 1 step<" in step_page

    assert html.unescape(re.search(r'<div class="full-prompt">(.*?)</div>', page, re.S)[1]) == (
        QUESTION
    )
    assert "Kept at 4 steps, 7 rollouts in all." in page
    assert steps_of(page) == [
        {"step": "1", "rollouts": "2", "mean": "0.5", "spread": "1", "tokens": "3.5",
         "best": "395? no: 395", "worst": "395"},
        {"step": "2", "rollouts": "2", "mean": "1", "spread": "0", "tokens": "2",
         "best": "395", "worst": None},
        {"step": "3", "rollouts": "2", "mean": "0.75", "spread": "0.5", "tokens": "3",
         "best": "391", "worst": "395"},
        {"step": "validation 2", "rollouts": "1", "mean": "0", "spread": "0", "tokens": "3",
         "best": "400", "worst": None},
    ]  # fmt: skip
    assert "rewards do not differ" in page
    # The plots follow the training steps only.
    assert len(re.findall(r'<figure class="plot">', page)) == 2
    assert page.count('<circle class="dot"') == 2 * 3


def test_the_same_prompt_hashes_alike_and_a_different_one_does_not() -> None:
    """Roles and contents decide: extra nulls a client adds do not; a token prompt and a text
    prompt are told apart from a chat one; a prompt shared with an earlier call is not hashed."""
    base = chat(1, 0, 0, "x", None)["calls"][0]
    padded = chat(1, 5, 0, "y", None)["calls"][0]
    padded["prompt"]["messages"] = [{**m, "name": None} for m in padded["prompt"]["messages"]]
    changed = chat(1, 0, 0, "x", None, "What is 17 * 23 + 5?")["calls"][0]
    tokens, text = call(0, "x", prompt_ids=[1, 2, 3]), call(0, "x", prompt_ids=[])
    text["prompt"]["text"] = "[1, 2, 3]"
    shared = call(1, "x", prompt_ids=[4], prefix_call=0, prefix_len=3)
    hashes = [prompt_hash(c) for c in (base, padded, changed, tokens, text)]
    assert hashes[0] == hashes[1] and len(set(hashes[1:])) == 4 and None not in hashes
    assert prompt_hash(shared) is None and prompt_hash({"prompt": None}) is None
