"""One output written by several proxies: each its own replica directory, read as one store.

A client whose router is not sticky sends the turns of one trajectory to two proxies; with the
trajectory id it gave, `trace-proxy show` and the viewer show one trajectory with both turns,
in order, each prompt whole.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from support.proxies import running_proxy

from trace_proxy.show import show
from trace_proxy.store.replicas import store_roots
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import Viewer
from trace_proxy.ui.urls import trajectory_url

FAST = {"capture_mode": "inline", "export_mode": "inline"}


def headers(turn: int, done: bool) -> dict[str, str]:
    return {"X-Rollout-Experiment": "exp", "X-Rollout-Step": "1",
            "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0",
            "X-Rollout-Trajectory-Id": "episode-7", "X-Rollout-Done": str(done).lower(),
            "X-Turn": str(turn)}  # fmt: skip


async def test_a_trajectory_whose_calls_reached_two_proxies_reads_as_one(
    fake_vllm: tuple[Any, str], tmp_path: Path
) -> None:
    _, upstream = fake_vllm
    output = tmp_path / "run"
    prompt: list[int] = [9707, 1879, 13]
    async with (
        running_proxy([upstream], output / "replicas" / "a", **FAST) as (_, proxy_a),
        running_proxy([upstream], output / "replicas" / "b", **FAST) as (_, proxy_b),
        aiohttp.ClientSession() as session,
    ):
        for turn, proxy in enumerate((proxy_a, proxy_b, proxy_a)):
            body = {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 4,
                    "return_token_ids": True}  # fmt: skip
            async with session.post(proxy + "/v1/completions", json=body,
                                    headers=headers(turn, turn == 2)) as response:  # fmt: skip
                answer = await response.json()
            prompt = [*prompt, *answer["choices"][0]["token_ids"], 198 + turn]
    assert len(store_roots(output)) == 2
    printed = io.StringIO()
    assert show(output, out=printed) == 0
    lines = printed.getvalue().splitlines()
    [header] = [line for line in lines if line.startswith("== ")]
    assert "id episode-7" in header and " 3 calls," in header
    index = StoreIndex([output], min_interval=0)
    index.refresh(force=True)
    [run] = index.runs.values()
    [entry] = run.steps[(False, 1)].entries
    assert (entry.calls, len(entry.parts)) == (3, 2)
    viewer = Viewer(index)
    async with TestClient(TestServer(viewer.app())) as client:
        page = await client.get(trajectory_url(run, entry.id))
        assert page.status == 200
        raw = await (await client.get(trajectory_url(run, entry.id, raw=True))).json()
        assert sorted(len(part["calls"]) for part in raw) == [1, 2]  # both records, as stored
        other = next(part.id for part in entry.parts if part.id != entry.id)
        assert (await client.get(trajectory_url(run, other))).status == 200  # either id opens it


def test_joined_calls_are_in_order_with_whole_prompts() -> None:
    from trace_proxy.store.replicas import joined

    def call(index: int, start: float, ids: list[int], ref: int | None = None) -> dict[str, Any]:
        shared = None if ref is None else {"token_ids": 2}
        prompt: dict[str, Any] = {"token_ids": ids, "prefix_call": ref, "prefix_len": shared}
        return {"index": index, "start": start, "end": start + 0.1, "prompt": prompt,
                "outputs": [{"index": 0, "token_ids": [50 + index], "text": "x"}]}  # fmt: skip

    a = {"id": "a", "start": 0.0, "end": 2.1, "status": "ok", "reward": None,
         "calls": [call(0, 0.0, [1, 2]), call(1, 2.0, [60], ref=0)],
         "tools": [{"requested_by": 1, "start": 2.1}], "summary": {"calls": 2}}  # fmt: skip
    b = {"id": "b", "start": 1.0, "end": 1.1, "status": "error", "reward": 1.0,
         "calls": [call(0, 1.0, [1, 2, 50, 7])], "tools": [], "summary": {"calls": 1}}  # fmt: skip
    record = joined([b, a])
    assert [c["start"] for c in record["calls"]] == [0.0, 1.0, 2.0]
    assert [c["index"] for c in record["calls"]] == [0, 1, 2]
    # prefix sharing undone: the third call's prompt is whole, no reference into another part
    assert record["calls"][2]["prompt"]["token_ids"] == [1, 2, 60]
    assert record["calls"][2]["prompt"]["prefix_call"] is None
    assert record["tools"][0]["requested_by"] == 2
    assert (record["status"], record["reward"], record["parts"]) == ("error", 1.0, ["a", "b"])
    assert record["summary"]["calls"] == 3 and (record["start"], record["end"]) == (0.0, 2.1)
