"""Keys from where RL frameworks put their sessions: URL paths (`--map path:...`), SkyRL's
`/finish_session`, and mapped ids that leave step, group and rollout to inference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from proxy_helpers import running_proxy, trajectories

from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.trajectories.keys import parse_mapping

SESSIONS = r"path:strip=/^/sessions/(?P<trajectory_id>[^/]+)/"
PROMPT = [151644, 872, 198, 9707, 1879, 151645, 198, 151644, 77091, 198, 40, 2776, 264, 1273]


def test_path_rules_parse_and_take_their_match_out_of_the_route() -> None:
    resolver = MetadataResolver([parse_mapping(SESSIONS)])
    forwarded, parsed, items = resolver.map_path("/sessions/s%201/v1/completions?x=1")
    assert (forwarded, parsed) == ("/v1/completions?x=1", "/v1/completions")
    hints = resolver.resolve(CIMultiDict(), items, None)
    assert hints.values == {"trajectory_id": "s 1"}
    assert hints.sources == {"trajectory_id": "map:" + SESSIONS}
    keep = MetadataResolver([parse_mapping(SESSIONS.replace("strip", "keep"))])
    forwarded, parsed, _ = keep.map_path("/sessions/a/v1/completions")
    assert (forwarded, parsed) == ("/sessions/a/v1/completions", "/v1/completions")
    assert resolver.map_path("/v1/models") == ("/v1/models", None, [])


@pytest.mark.parametrize(
    "bad",
    [
        "path:sessions=trajectory_id",
        "path:strip=trajectory_id",
        "path:cut=/(?P<step>\\d+)/",
        "path:strip=/no-groups/",
    ],
)
def test_bad_path_rules_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_mapping(bad)


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], headers: dict[str, str]
) -> bytes:
    body = {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 4, "return_token_ids": True}
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        return await response.read()


async def test_a_session_in_the_url_path_becomes_the_trajectory(
    tmp_path: Path, fake_vllm: Any
) -> None:
    fake, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, map=[SESSIONS]) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        seen = len(fake.requests)
        for sid in ("alpha", "beta"):
            for turn in range(2):
                await _complete(session, f"{proxy}/sessions/{sid}/v1/completions",
                                [*PROMPT, turn], {})  # fmt: skip
        forwarded = [r.path for r in fake.requests[seen:]]
    assert forwarded == ["/v1/completions"] * 4  # the session is gone before forwarding
    by_id = {t["key"]["trajectory_id"]: t for t in trajectories(tmp_path)}
    assert sorted(by_id) == ["alpha", "beta"]
    for record in by_id.values():
        assert len(record["calls"]) == 2
        assert record["calls"][0]["route"] == "/v1/completions"
        assert record["key"]["sources"]["trajectory_id"] == "map:" + SESSIONS
        # the id only groups: the rest is inferred as for keyless traffic
        assert record["key"]["step"] == 0
        assert record["key"]["sources"]["rollout_n"] == "inferred:order_in_group"
    assert by_id["alpha"]["key"]["sample_hash"] == by_id["beta"]["key"]["sample_hash"]
    assert {by_id[s]["key"]["rollout_n"] for s in by_id} == {0, 1}


async def test_finish_session_closes_the_skyrl_session_at_once(
    tmp_path: Path, fake_vllm: Any
) -> None:
    fake, upstream = fake_vllm
    async with (
        running_proxy([upstream], tmp_path, idle_timeout=3600.0) as (service, proxy),
        aiohttp.ClientSession() as session,
    ):
        for sid in ("7_0", "7_1"):
            await _complete(session, proxy + "/v1/completions", PROMPT, {"X-Session-ID": sid})
        seen = len(fake.requests)
        async with session.post(proxy + "/finish_session?session_id=7_0") as response:
            assert response.status == 404  # forwarded: this upstream has no such route
        assert fake.requests[seen].path == "/finish_session"
        assert fake.requests[seen].query == {"session_id": "7_0"}
        await service.flush()
        [closed] = trajectories(tmp_path)  # 7_1 is still open: nothing ended it
        assert closed["key"]["trajectory_id"] == "7_0"
        assert closed["close_reason"] == "done"
    records = {t["key"]["trajectory_id"]: t for t in trajectories(tmp_path)}
    assert records["7_1"]["close_reason"] == "shutdown"
