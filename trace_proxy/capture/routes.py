"""Which routes are worth a copy: the hot path asks this once per request, by a dict lookup."""

from __future__ import annotations

from enum import Enum

from trace_proxy.capture.control import EVENTS
from trace_proxy.capture.dialects import DIALECTS
from trace_proxy.capture.sessions import METHODS as SESSION_METHODS
from trace_proxy.capture.sessions import SESSION_ENDS


class RouteKind(str, Enum):
    GENERATE = "generate"
    CONTROL = "control"
    TOOL = "tool"  # a tool server routed through the proxy (--tool-route)
    SESSION_END = "session_end"  # a client ends a session (capture/sessions.py)
    OTHER = "other"


_GENERATE_METHODS = frozenset({"POST", "PUT"})
_CONTROL_METHODS = frozenset({"POST", "PUT", "GET"})


def classify(method: str, path: str) -> RouteKind:
    if path in DIALECTS and method in _GENERATE_METHODS:
        return RouteKind.GENERATE
    if path in EVENTS and method in _CONTROL_METHODS:
        return RouteKind.CONTROL
    if path in SESSION_ENDS and method in SESSION_METHODS:
        return RouteKind.SESSION_END
    return RouteKind.OTHER
