"""Every metadata source, their order, and malformed values kept as annotations; keys from where
RL frameworks put their sessions: URL paths (`--map path:...`), SkyRL's `/finish_session`, and
mapped ids that leave step, group and rollout to inference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from support.proxies import running_proxy, trajectories

from trace_proxy.capture.metadata import MetadataResolver, split_rollout_prefix
from trace_proxy.trajectories.keys import parse_mapping

DEFAULT_RULES = [parse_mapping("header:X-Session-ID=trajectory_id")]


def resolve(headers: dict[str, str] | list[tuple[str, str]], path: str = "/v1/x", body=None):
    _, items = split_rollout_prefix(path)
    return MetadataResolver(DEFAULT_RULES).resolve(CIMultiDict(headers), items, body)


def test_headers() -> None:
    hints = resolve(
        {
            "X-Rollout-Experiment": "exp1",
            "X-Rollout-Step": "3",
            "X-Rollout-Sample-Index": "17",
            "X-Rollout-N": "2",
            "X-Rollout-Validate": "true",
            "X-Rollout-Trajectory-Id": "t-1",
            "X-Rollout-Done": "1",
        }
    )
    assert hints.values == {
        "experiment": "exp1", "step": 3, "sample_index": 17, "rollout_n": 2,
        "validate": True, "trajectory_id": "t-1", "done": True,
    }  # fmt: skip
    assert hints.sources["step"] == "header:X-Rollout-Step"
    assert hints.annotations == []


def test_baggage_with_properties_and_percent_encoding() -> None:
    hints = resolve(
        {"baggage": "other=1, rollout.step=4;prop=x, rollout.experiment=my%20exp,rollout.n=0"}
    )
    assert hints.values == {"step": 4, "experiment": "my exp", "rollout_n": 0}
    assert hints.sources["step"] == "baggage:rollout.step"


def test_path_prefix_is_parsed_and_stripped() -> None:
    rest, items = split_rollout_prefix("/rollout/step=2/sample_index=5/v1/chat/completions?x=1")
    assert rest == "/v1/chat/completions?x=1"
    assert items == [("step", "2"), ("sample_index", "5")]
    assert split_rollout_prefix("/rollout/nothing/v1") == ("/rollout/nothing/v1", [])
    assert split_rollout_prefix("/v1/models") == ("/v1/models", [])


def test_headers_win_over_baggage_over_path_over_mappings() -> None:
    hints = resolve(
        {
            "X-Rollout-Step": "1",
            "baggage": "rollout.step=2,rollout.sample_index=8",
            "X-Session-ID": "sess-9",
        },
        path="/rollout/step=3/sample_index=9/rollout_n=4/v1/completions",
    )
    assert hints.values["step"] == 1
    assert hints.values["sample_index"] == 8
    assert hints.values["rollout_n"] == 4
    assert hints.values["trajectory_id"] == "sess-9"
    assert hints.sources["trajectory_id"] == "map:header:X-Session-ID=trajectory_id"


def test_malformed_value_becomes_annotation_and_falls_through() -> None:
    hints = resolve({"X-Rollout-Step": "three", "baggage": "rollout.step=3"})
    assert hints.values["step"] == 3
    assert hints.annotations == [
        {
            "field": "step",
            "source": "header:X-Rollout-Step",
            "value": "three",
            "error": "expected a non-negative integer",
        }
    ]


def test_a_count_too_long_for_a_file_name_or_an_int64_falls_through() -> None:
    hints = resolve({"X-Rollout-Step": "9" * 19, "X-Rollout-Sample-Index": "9" * 18})
    assert "step" not in hints.values and hints.values["sample_index"] == 10**18 - 1
    assert hints.annotations[0]["error"] == "expected at most 18 digits"


def test_unknown_path_key_is_annotated() -> None:
    hints = resolve({}, path="/rollout/stp=1/v1/completions")
    assert hints.values == {}
    assert hints.annotations[0]["field"] == "stp"


def test_body_mapping_with_regex_groups() -> None:
    rules = [parse_mapping(r"body:rid=/^(?P<trajectory_id>traj-\d+)-turn-(?P<sample_index>\d+)$/")]
    hints = MetadataResolver(rules).resolve(CIMultiDict(), [], {"rid": "traj-42-turn-7"})
    assert hints.values == {"trajectory_id": "traj-42", "sample_index": 7}


def test_request_id_header_and_body_mappings() -> None:
    rules = [
        parse_mapping("header:X-Request-Id=trajectory_id"),
        parse_mapping("body:request_id=experiment"),
    ]
    hints = MetadataResolver(rules).resolve(
        CIMultiDict({"X-Request-Id": "r1"}), [], {"request_id": "e1"}
    )
    assert hints.values == {"trajectory_id": "r1", "experiment": "e1"}


@pytest.mark.parametrize(
    "rule", ["header:X", "cookie:X=step", "body:rid=/(?P<nope>x)/", "body:rid=/(/", "header:=step"]
)
def test_bad_mapping_rules_are_rejected(rule: str) -> None:
    with pytest.raises(ValueError):
        parse_mapping(rule)


def test_affinity_key_uses_trajectory_identity() -> None:
    resolver = MetadataResolver(DEFAULT_RULES)
    a = resolver.affinity_key(CIMultiDict({"X-Session-ID": "s1"}), [])
    b = resolver.affinity_key(CIMultiDict({"X-Rollout-Trajectory-Id": "s1"}), [])
    assert a == b == "id:s1"
    assert resolver.affinity_key(CIMultiDict(), []) == ""


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
