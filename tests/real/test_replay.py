"""`trace-proxy replay` against the REAL vLLM CPU build: a multi-turn chat and a token-in
generate trajectory recorded through the proxy, replayed to the real server, land as a new run
whose answers are the real server's, and the viewer compares each with the recorded one.

The replay goes to the server that answered when recording, with greedy decoding: the same
inputs to the same weights give the same tokens, so the replayed answers must equal the
recorded ones, turn by turn (a replay that changed a prompt or a parameter would not).
"""

from __future__ import annotations

import asyncio
import html
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp.test_utils import TestClient, TestServer
from support.proxies import running_proxy, trajectories

from trace_proxy.cli import main
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.server import Viewer

if TYPE_CHECKING:
    from .conftest import RealServer

Json = dict[str, Any]
PROMPT_IDS = [785, 6722, 315, 9625, 374]  # "The capital of France is"


async def post(http: aiohttp.ClientSession, url: str, body: Json, headers: Json) -> bytes:
    async with http.post(url, json=body, headers=headers) as answer:
        data = await answer.read()
        assert answer.status == 200, data[:500]
        return data


async def record(real_vllm: RealServer, store: Path) -> None:
    """Step 1: sample 0 chats for two turns (the second streamed); sample 1 generates from
    token ids for two turns (the second's prompt: the first's, its answer and more ids)."""
    chat_key = {"X-Rollout-Step": "1", "X-Rollout-Sample-Index": "0", "X-Rollout-N": "0",
                "X-Rollout-Trajectory-Id": "chat", "Authorization": "Bearer rec-key"}  # fmt: skip
    ids_key = {**chat_key, "X-Rollout-Sample-Index": "1", "X-Rollout-Trajectory-Id": "ids"}
    async with (
        running_proxy([real_vllm.base_url], store) as (_, proxy),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http,
    ):
        chat: Json = {"model": real_vllm.model, "max_tokens": 10, "temperature": 0,
                      "return_token_ids": True, "stream": False,
                      "messages": [{"role": "user", "content": "Name three colours."}]}  # fmt: skip
        first = orjson.loads(await post(http, proxy + "/v1/chat/completions", chat, chat_key))
        chat["messages"] = [*chat["messages"], first["choices"][0]["message"],
                            {"role": "user", "content": "And three animals?"}]  # fmt: skip
        await post(http, proxy + "/v1/chat/completions", {**chat, "stream": True}, chat_key)
        generate: Json = {"model": real_vllm.model, "token_ids": PROMPT_IDS, "stream": False,
                          "sampling_params": {"max_tokens": 8, "temperature": 0,
                                              "logprobs": 1}}  # fmt: skip
        answer = orjson.loads(await post(http, proxy + "/inference/v1/generate", generate, ids_key))
        generate["token_ids"] = PROMPT_IDS + answer["choices"][0]["token_ids"] + [13, 576]
        await post(http, proxy + "/inference/v1/generate", {**generate, "stream": True}, ids_key)


def answers(trajectory: Json) -> list[tuple[Any, ...]]:
    return [
        (c["dialect"], c["stream"], c["outputs"][0]["text"], c["outputs"][0]["token_ids"])
        for c in trajectory["calls"]
    ]


async def test_a_recorded_run_replayed_to_the_real_server(
    real_vllm: RealServer, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await record(real_vllm, store)
    recorded = {t["key"]["trajectory_id"]: t for t in trajectories(store)}
    assert set(recorded) == {"chat", "ids"}

    argv = ["replay", str(store), "--upstream", real_vllm.base_url, "--step", "1",
            "--model", real_vllm.model, "--experiment", "replayed",
            "--header", "Authorization: Bearer replay-key",
            "--body-field", "return_token_ids=true"]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0

    replayed = {t["labels"]["replay_of"]: t for t in trajectories(store)
                if t["key"]["experiment"] == "replayed"}  # fmt: skip
    assert set(replayed) == {t["id"] for t in recorded.values()}
    for original in recorded.values():
        new = replayed[original["id"]]
        assert new["upstreams"] == [real_vllm.base_url]
        assert all(c["http_status"] == 200 and c["error"] is None for c in new["calls"])
        assert all(c["model"] == real_vllm.model for c in new["calls"])
        assert all(c["request_headers"]["authorization"] == "[redacted]" for c in new["calls"]
                   if c["request_headers"] is not None)  # fmt: skip
        assert answers(new) == answers(original)
        assert all(c["outputs"][0]["token_ids"] for c in new["calls"])
    assert b"replay-key" not in b"".join(p.read_bytes() for p in store.rglob("*.jsonl"))

    viewer = Viewer(StoreIndex([store], min_interval=0))
    viewer.index.refresh(force=True)
    async with TestClient(TestServer(viewer.app())) as client:
        [run] = [r for r in viewer.index.runs.values() if r.experiment == "replayed"]
        base = f"/run/0/{run.project_dir}/{run.experiment_dir}"
        for new in replayed.values():
            page = await (await client.get(f"{base}/t/{new['id']}")).text()
            [link] = re.findall(r'id="compare-recorded" href="([^"]+)"', page)
            compare = await client.get(html.unescape(link))
            assert compare.status == 200
            text = await compare.text()
            assert text.count('class="traj-link"') == 2
            assert "These rollouts do not differ." in text
