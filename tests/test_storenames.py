"""Store names: any text to one safe path component, injectively, and back."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trace_proxy.store.names import (
    EMPTY,
    MARK,
    MAX_NAME,
    decode_name,
    digest,
    is_safe_component,
    store_name,
)

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
