"""What a record keeps of a request's headers: secrets replaced, framing headers left out,
text repaired. The names' meanings are remembered across calls; the answer must not change."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_proxy.capture import redact
from trace_proxy.capture.redact import REDACTED, recorded_headers
from trace_proxy.safejson import clean_text

NAMES = st.sampled_from(
    ["Authorization", "Cookie", "X-Api-Key", "Host", "Content-Length", "Connection",
     "X-Rollout-Step", "x-rollout-step", "User-Agent", "X-Session-Token", "Accept",
     "X-\udcff-Bad"]
) | st.text(min_size=1, max_size=12)  # fmt: skip
VALUES = st.text(max_size=20) | st.sampled_from(["caf\udce9", "Bearer sk-123", "7"])


def expected(items: list[tuple[str, str]]) -> dict[str, str]:
    kept: dict[str, str] = {}
    for name, value in items:
        lowered = clean_text(name.lower())
        if lowered in {"content-length", "host", "connection", "keep-alive"}:
            continue
        kept[lowered] = REDACTED if redact.is_secret_header(lowered) else clean_text(value)
    return kept


@given(st.lists(st.lists(st.tuples(NAMES, VALUES), max_size=8), max_size=6))
def test_recorded_headers_are_the_same_on_every_call(calls: list[list[tuple[str, str]]]) -> None:
    for items in calls:  # the same names again and again, as a client sends them
        assert recorded_headers(items) == expected(items)


def test_secrets_and_framing_headers_never_reach_a_record() -> None:
    items = [("Authorization", "Bearer sk-live"), ("Cookie", "a=b"), ("X-API-KEY", "k"),
             ("Host", "gpu-0:8000"), ("Content-Length", "12"), ("X-Rollout-Step", "3")]  # fmt: skip
    for _ in range(2):
        kept = recorded_headers(items)
        assert kept == {"authorization": REDACTED, "cookie": REDACTED, "x-api-key": REDACTED,
                        "x-rollout-step": "3"}  # fmt: skip
        assert "sk-live" not in repr(redact._NAMES)


def test_the_names_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redact, "MAX_NAMES", 8)
    for number in range(50):
        assert recorded_headers([(f"X-Name-{number}", "v")]) == {f"x-name-{number}": "v"}
        assert len(redact._NAMES) <= 8
