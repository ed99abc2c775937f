"""Routes by which a client says a session (one trajectory) is over, like `X-Rollout-Done`.

SkyRL's remote inference client sends `POST /finish_session?session_id=S` when a trajectory
ends; S is the value its generate calls carried in `X-Session-ID`. The trajectory those calls
were grouped into (through the `--map` rule on that header, the default one) is closed as
done, at once, instead of waiting for the idle timeout. The request itself is forwarded as
every other request is.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """The query parameter naming the session, and the header that named it on each call."""

    parameter: str
    header: str


SESSION_ENDS: dict[str, SessionEnd] = {
    "/finish_session": SessionEnd("session_id", "X-Session-ID"),  # SkyRL
}
METHODS = frozenset({"POST"})


def ended_session(path: str, query: str) -> tuple[str, str] | None:
    """(header, session) for a session-end route that names its session; else None."""
    end = SESSION_ENDS.get(path)
    if end is None:
        return None
    for name, value in parse_qsl(query, keep_blank_values=False):
        if name == end.parameter and value:
            return end.header, value
    return None
