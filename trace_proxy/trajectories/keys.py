"""A trajectory's key as requests carry it: the key fields, how each value is checked, the
mapping rules that read them from what clients already send, and the hints found for one
call. The capture stage reads these from requests (`capture/metadata.py`); the assembler
turns hints into a `RolloutKey`; the configuration checks mapping rules when it starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trace_proxy.safejson import clean_text
from trace_proxy.trajectories.record import RolloutKey

FIELDS = (
    "project",
    "experiment",
    "step",
    "sample_index",
    "rollout_n",
    "validate",
    "trajectory_id",
    "done",
    "sample_id",
)
HEADER_NAMES = {
    "project": "X-Rollout-Project",
    "experiment": "X-Rollout-Experiment",
    "step": "X-Rollout-Step",
    "sample_index": "X-Rollout-Sample-Index",
    "rollout_n": "X-Rollout-N",
    "validate": "X-Rollout-Validate",
    "trajectory_id": "X-Rollout-Trajectory-Id",
    "done": "X-Rollout-Done",
    "sample_id": "X-Rollout-Sample-Id",
}
# Not a key field: the policy version that produced one call (`GenerateCall.weight_version`).
WEIGHT_VERSION_HEADER = "X-Rollout-Weight-Version"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
MAX_VALUE_LEN = 256
MAX_COUNT_DIGITS = 18  # a step names a file of the store, and backends keep it as an int64


def _name(value: str) -> str:
    """Bytes that are not UTF-8 (lone surrogates, as aiohttp decodes them) become U+FFFD:
    a name must be hashed by the sampler and written in records, and the forwarder and the
    capture process (which gets the repaired text) must read the same name."""
    if not value or len(value) > MAX_VALUE_LEN or any(c in value for c in "\r\n\t"):
        raise ValueError(f"expected 1-{MAX_VALUE_LEN} printable characters")
    return clean_text(value)


def _count(value: str) -> int:
    if not value.isdigit():
        raise ValueError("expected a non-negative integer")
    if len(value) > MAX_COUNT_DIGITS:
        raise ValueError(f"expected at most {MAX_COUNT_DIGITS} digits")
    return int(value)


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected true or false")


PARSERS: dict[str, Callable[[str], Any]] = {
    "project": _name,
    "experiment": _name,
    "step": _count,
    "sample_index": _count,
    "rollout_n": _count,
    "validate": _flag,
    "trajectory_id": _name,
    "done": _flag,
    "sample_id": _name,
}


@dataclass(frozen=True, slots=True)
class MappingRule:
    """`SOURCE:NAME=FIELD` or `SOURCE:NAME=/REGEX/` (named groups are fields)."""

    text: str
    source: str  # "header" | "body" | "path"
    name: str  # a header or body field; for "path", "strip" or "keep"
    field: str | None
    pattern: re.Pattern[str] | None

    def extract(self, value: str) -> dict[str, str]:
        if self.field is not None:
            return {self.field: value}
        assert self.pattern is not None
        match = self.pattern.search(value)
        if match is None:
            return {}
        return {k: v for k, v in match.groupdict().items() if v is not None}


def parse_mapping(text: str) -> MappingRule:
    source, sep, rest = text.partition(":")
    name, eq, target = rest.partition("=")
    if not sep or not eq or source not in ("header", "body", "path") or not name:
        raise ValueError(f"{text!r} is not SOURCE:NAME=FIELD or SOURCE:NAME=/REGEX/")
    regex = len(target) >= 2 and target.startswith("/") and target.endswith("/")
    if source == "path" and (name not in PATH_ACTIONS or not regex):
        raise ValueError(f"{text!r} is not path:strip=/REGEX/ or path:keep=/REGEX/")
    if regex:
        try:
            pattern = re.compile(target[1:-1])
        except re.error as exc:
            raise ValueError(f"bad regular expression in {text!r}: {exc}") from None
        unknown = set(pattern.groupindex) - set(FIELDS)
        if not pattern.groupindex or unknown:
            raise ValueError(f"{text!r}: named groups must be key fields ({', '.join(FIELDS)})")
        return MappingRule(text, source, name, None, pattern)
    if target not in FIELDS:
        raise ValueError(f"{text!r}: {target!r} is not a key field ({', '.join(FIELDS)})")
    return MappingRule(text, source, name, target, None)


PATH_ACTIONS = ("strip", "keep")


@dataclass(slots=True)
class KeyHints:
    """Key fields found for one call, where each came from, and what was malformed."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    annotations: list[dict[str, str]] = field(default_factory=list)
    # The key the assembler made of these hints to look a prompt up, for the call it then
    # adds (`Assembler.add_call` takes it: a call's key becomes its trajectory's, and may be
    # filled in there, so no other call may share it).
    key: RolloutKey | None = None

    def sample(self) -> tuple[Any, ...] | None:
        """What the sampler decides on, as these hints name it (None without a sample
        index): equal hints from equal headers in the forwarder and the capture process."""
        v = self.values
        if "sample_index" not in v:
            return None
        return (v.get("project"), v.get("experiment"), v.get("step"), v.get("validate"),
                v["sample_index"])  # fmt: skip

    def offer(self, name: str, raw: str, source: str) -> None:
        if name in self.values:
            return
        try:
            self.values[name] = PARSERS[name](raw)
        except ValueError as exc:
            self.annotations.append({"field": name, "source": clean_text(source),
                                     "value": clean_text(raw[:MAX_VALUE_LEN]),
                                     "error": str(exc)})  # fmt: skip
            return
        self.sources[name] = source
