"""Header rules of a forwarding proxy (RFC 9110 section 7.6.1): hop-by-hop headers stop here."""

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
# Set by the client library for the upstream connection itself, or answered by this proxy.
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {"host", "expect"}
# aiohttp would otherwise invent these when the client did not send them.
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def _end_to_end(items: list[tuple[str, str]], dropped: frozenset[str]) -> CIMultiDict[str]:
    listed = _connection_tokens(items)
    return CIMultiDict(
        (name, value)
        for name, value in items
        if name.lower() not in dropped and name.lower() not in listed
    )


def upstream_request_headers(
    items: list[tuple[str, str]], client_ip: str | None, scheme: str, host: str | None
) -> CIMultiDict[str]:
    headers = _end_to_end(items, NOT_FORWARDED_UPSTREAM)
    forwarded_for = headers.get("X-Forwarded-For")
    if client_ip:
        headers["X-Forwarded-For"] = f"{forwarded_for}, {client_ip}" if forwarded_for else client_ip
    headers.setdefault("X-Forwarded-Proto", scheme)
    if host:
        headers.setdefault("X-Forwarded-Host", host)
    return headers


def client_response_headers(items: list[tuple[str, str]]) -> CIMultiDict[str]:
    return _end_to_end(items, HOP_BY_HOP)
