"""Which routes are worth a copy: the hot path asks this once per request, by a dict lookup."""

from __future__ import annotations

from enum import Enum

from trace_proxy.capture.control import EVENTS
from trace_proxy.capture.dialects import DIALECTS


class RouteKind(str, Enum):
    GENERATE = "generate"
    CONTROL = "control"
    TOOL = "tool"  # a tool server routed through the proxy (--tool-route)
    OTHER = "other"


_GENERATE_METHODS = frozenset({"POST", "PUT"})
_CONTROL_METHODS = frozenset({"POST", "PUT", "GET"})


def classify(method: str, path: str) -> RouteKind:
    if path in DIALECTS and method in _GENERATE_METHODS:
        return RouteKind.GENERATE
    if path in EVENTS and method in _CONTROL_METHODS:
        return RouteKind.CONTROL
    return RouteKind.OTHER
