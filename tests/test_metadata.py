"""Every metadata source, their order, and malformed values kept as annotations."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

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
