"""Where a call belongs: trajectory key fields from headers, baggage, a path prefix, or mappings.

Sources are tried in a fixed order and the first valid value of each field wins:
  1. `X-Rollout-*` headers,
  2. the W3C `baggage` header (`rollout.*` keys),
  3. the URL path prefix `/rollout/<field>=<value>/...` (removed before forwarding),
  4. mapping rules over what clients already send (`header:X-Session-ID=trajectory_id`,
     `body:rid=/^(?P<trajectory_id>.+)-\\d+$/`,
     `path:strip=/^/sessions/(?P<trajectory_id>[^/]+)/`, ...). A `path:` rule reads the URL
     path; what it matched is not part of the route the call is parsed as, and with `strip`
     it is removed before forwarding too (`keep` forwards the path as it came, for an
     upstream that routes on it).
A malformed value never fails the request: it becomes an annotation on the record and the field
falls through to the next source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from trace_proxy.safejson import clean_text
from trace_proxy.trajectories.keys import (
    HEADER_NAMES,
    MAX_VALUE_LEN,
    PARSERS,
    KeyHints,
    MappingRule,
    parse_mapping,
)

BAGGAGE_PREFIX = "rollout."
# Short names used in baggage (`rollout.n`) and in the path prefix (`/rollout/n=2/`).
ALIASES = {"n": "rollout_n"}
PATH_PREFIX = "/rollout/"
MAPPED_PATH = "map:"  # a path item a `path:` rule matched: ("map:" + rule, the whole path)


def split_rollout_prefix(raw_path: str) -> tuple[str, list[tuple[str, str]]]:
    """`/rollout/step=3/sample_index=1/v1/x?q` -> (`/v1/x?q`, [("step","3"), ...]).

    Only a prefix of `name=value` segments is taken; a path without one is returned unchanged.
    """
    if not raw_path.startswith(PATH_PREFIX):
        return raw_path, []
    path, qmark, query = raw_path.partition("?")
    segments = path[len(PATH_PREFIX) :].split("/")
    items: list[tuple[str, str]] = []
    for segment in segments:
        name, eq, value = segment.partition("=")
        if not eq:
            break
        items.append((unquote(name), unquote(value)))
    if not items:
        return raw_path, []
    rest = "/" + "/".join(segments[len(items) :])
    return rest + qmark + query, items


def _baggage_items(header: str) -> list[tuple[str, str]]:
    items = []
    for member in header.split(","):
        pair = member.split(";", 1)[0]
        key, eq, value = pair.partition("=")
        if eq:
            items.append((unquote(key.strip()), unquote(value.strip())))
    return items


class MetadataResolver:
    """Applies the sources in order; one instance per proxy, rules parsed once."""

    def __init__(self, rules: list[MappingRule]) -> None:
        self._header_rules = [r for r in rules if r.source == "header"]
        self._body_rules = [r for r in rules if r.source == "body"]
        self.path_rules = [r for r in rules if r.source == "path"]
        self._path_by_text = {r.text: r for r in self.path_rules}

    @classmethod
    def of(cls, rules: Sequence[str]) -> MetadataResolver:
        """A resolver for `--map` rules as the options give them."""
        return cls([parse_mapping(rule) for rule in rules])

    def map_path(self, target: str) -> tuple[str, str | None, list[tuple[str, str]]]:
        """`path:` rules on a request target (path and query): the target to forward, the
        path to parse the call as (None: unchanged), and the items `resolve` reads the key
        fields from. Each rule that matches takes its match out of the path it parses as;
        `strip` rules out of the forwarded target too."""
        path, qmark, query = target.partition("?")
        parsed, forwarded = path, path
        items: list[tuple[str, str]] = []
        for rule in self.path_rules:
            assert rule.pattern is not None
            match = rule.pattern.search(parsed)
            if match is None:
                continue
            items.append((MAPPED_PATH + rule.text, parsed))
            rest = _rooted(parsed[: match.start()] + parsed[match.end() :])
            if rule.name == "strip" and forwarded == parsed:
                forwarded = rest
            parsed = rest
        if not items:
            return target, None, []
        return forwarded + qmark + query, parsed, items

    def resolve(
        self,
        headers: Mapping[str, str],
        path_items: list[tuple[str, str]],
        body: Mapping[str, Any] | None,
    ) -> KeyHints:
        hints = KeyHints()
        for name, header in HEADER_NAMES.items():
            value = headers.get(header)
            if value is not None:
                hints.offer(name, value, "header:" + header)
        for baggage in _all(headers, "baggage"):
            for key, value in _baggage_items(baggage):
                if key.startswith(BAGGAGE_PREFIX):
                    self._offer_named(hints, key[len(BAGGAGE_PREFIX) :], value, "baggage:" + key)
        mapped_paths = []
        for key, value in path_items:
            if key.startswith(MAPPED_PATH):
                mapped_paths.append((key[len(MAPPED_PATH) :], value))
            else:
                self._offer_named(hints, key, value, "path")
        for rule in self._header_rules:
            value = headers.get(rule.name)
            if value is not None:
                for name, part in rule.extract(value).items():
                    hints.offer(name, part, "map:" + rule.text)
        for text, path in mapped_paths:
            path_rule = self._path_by_text.get(text)
            if path_rule is not None:  # else a rule of another configuration: ignored
                for name, part in path_rule.extract(path).items():
                    hints.offer(name, unquote(part), "map:" + path_rule.text)
        if body is not None:
            for rule in self._body_rules:
                value = body.get(rule.name)
                if isinstance(value, (str, int)) and not isinstance(value, bool):
                    for name, part in rule.extract(str(value)).items():
                        hints.offer(name, part, "map:" + rule.text)
        return hints

    def affinity_key(self, headers: Mapping[str, str], path_items: list[tuple[str, str]]) -> str:
        """A cheap trajectory identity for upstream stickiness, from headers and path only."""
        hints = self.resolve(headers, path_items, None)
        values = hints.values
        if "trajectory_id" in values:
            return "id:" + str(values["trajectory_id"])
        if "sample_index" in values:
            parts = ("experiment", "step", "validate", "sample_index", "rollout_n")
            return "key:" + "/".join(str(values.get(p)) for p in parts)
        return ""

    @staticmethod
    def _offer_named(hints: KeyHints, key: str, value: str, source: str) -> None:
        key = ALIASES.get(key, key)
        if key in PARSERS:
            hints.offer(key, value, source)
        else:
            hints.annotations.append(
                {"field": clean_text(key[:MAX_VALUE_LEN]), "source": clean_text(source),
                 "value": clean_text(value[:MAX_VALUE_LEN]), "error": "unknown key field"}
            )  # fmt: skip


def _rooted(path: str) -> str:
    """A path with what a rule matched taken out: one leading slash, never empty."""
    return "/" + path.lstrip("/")


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        values: list[str] = getall(name, [])
        return values
    value = headers.get(name)
    return [value] if value is not None else []
