"""Header rules of a forwarding proxy (RFC 9110 section 7.6.1): hop-by-hop headers stop here.

The request side works on the raw header bytes the listener parsed, and yields the bytes that
go upstream: no decoding, no multidict, since this runs for every request.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict

# Connection-specific fields, plus the two meant for this proxy, not the origin.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "proxy-authenticate", "proxy-authorization",
    }
)  # fmt: skip
# Set by the upstream client for the connection itself, answered by this proxy, or naming
# the upstream to this proxy (proxy/upstreams.py).
NOT_FORWARDED_UPSTREAM = frozenset(
    name.encode()
    for name in HOP_BY_HOP | {"host", "expect", "x-forwarded-for", "x-trace-proxy-upstream"}
)
Fields = list[tuple[bytes, bytes]]


def _listed_in_connection(values: Iterable[bytes]) -> set[bytes]:
    """Names a Connection header declares hop-by-hop (lower-case)."""
    return {t.strip().lower() for value in values for t in value.split(b",") if t.strip()}


def upstream_request_fields(
    raw: Iterable[tuple[bytes, bytes]], client_ip: str | None, scheme: str, host: str | None
) -> Fields:
    """The client's end-to-end fields in their order, with X-Forwarded-For extended by the
    client's address and X-Forwarded-Proto/-Host added when absent."""
    fields: Fields = []
    forwarded_for: list[bytes] = []
    connection: list[bytes] = []
    has_proto = has_host = False
    for name, value in raw:
        lower = name.lower()
        if lower in NOT_FORWARDED_UPSTREAM:
            if lower == b"x-forwarded-for":
                forwarded_for.append(value)
            elif lower == b"connection":
                connection.append(value)
            continue
        has_proto = has_proto or lower == b"x-forwarded-proto"
        has_host = has_host or lower == b"x-forwarded-host"
        fields.append((name, value))
    if connection:
        listed = _listed_in_connection(connection)
        fields = [(n, v) for n, v in fields if n.lower() not in listed]
        forwarded_for = [] if b"x-forwarded-for" in listed else forwarded_for
    if client_ip:
        forwarded_for.append(client_ip.encode())
    if forwarded_for:
        fields.append((b"X-Forwarded-For", b", ".join(forwarded_for)))
    if not has_proto:
        fields.append((b"X-Forwarded-Proto", scheme.encode()))
    if host and not has_host:
        fields.append((b"X-Forwarded-Host", host.encode("utf-8", "surrogateescape")))
    return fields


def client_response_headers(items: list[tuple[str, str]]) -> CIMultiDict[str]:
    listed = {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }
    return CIMultiDict(
        (name, value)
        for name, value in items
        if name.lower() not in HOP_BY_HOP and name.lower() not in listed
    )
