"""What the hot path hands to capture: copies of one request/response and its timings.

The forwarder fills this in as bytes pass by and submits it once the response is finished;
nothing in here is parsed until the capture stage picks it up, off the forwarding path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from multidict import CIMultiDictProxy, MultiMapping


@dataclass(slots=True)
class Exchange:
    method: str
    path: str  # as forwarded (rollout prefix removed), without the query string
    query: str
    request_headers: CIMultiDictProxy[str]
    path_metadata: list[tuple[str, str]]
    upstream: str
    start: float
    request_body: bytes = b""
    status: int | None = None
    response_headers: MultiMapping[str] | None = None
    response_chunks: list[bytes] = field(default_factory=list)
    first_byte: float | None = None
    end: float | None = None
    error: str | None = None  # why the exchange did not complete normally
    tool_route: str | None = None  # the --tool-route prefix, for tool-server calls
    admitted: bool = False  # the sampler let it in on the hot path (headers named the sample)
    size: int = 0  # body bytes held, counted against the capture queue's byte budget
    # Why the bodies were not kept (capture fell behind): the call still counts in its
    # trajectory (`summary.calls_dropped`) and its done flag still closes it.
    dropped: str | None = None
    # Why the bodies were let go although the call is recorded (too large to hold for it):
    # the call is recorded as unparsed with this reason.
    bodies_skipped: str | None = None

    @property
    def response_body(self) -> bytes:
        return b"".join(self.response_chunks)

    @property
    def is_event_stream(self) -> bool:
        if self.response_headers is None:
            return False
        ctype = self.response_headers.get("Content-Type", "")
        return ctype.startswith("text/event-stream")


# What the marks of dropped exchanges may add to a full capture queue, in bytes: a mark is
# the exchange's head alone (a few hundred bytes), so this holds thousands of them.
MARKS_BYTES = 1 << 20


# The reason of a mark the forwarder sends instead of an exchange whose sample the sampler
# has refused for good: the capture process only counts it, as it would the whole exchange.
REFUSED = "sampler"


def dropped_mark(exchange: Exchange, reason: str) -> Exchange:
    """The exchange without its bodies, saying why they were not kept."""
    return replace(exchange, request_body=b"", response_chunks=[], size=0, dropped=reason)
