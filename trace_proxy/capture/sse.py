"""Server-sent events as vLLM and SGLang write them: `data: <json>` blocks, `: comment` lines."""

from __future__ import annotations

from collections.abc import Iterator


def iter_data(body: bytes) -> Iterator[bytes]:
    """The `data:` payloads of an event stream, in order; comments and other fields skipped.

    Multi-line data fields are joined with newlines, per the SSE specification, and a line
    ends with CRLF, LF or a lone CR, as it also says (vLLM and SGLang write LF).
    """
    if b"\r" in body:
        body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for block in body.split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            continue
        payload = b"\n".join(_field_value(line) for line in lines)
        yield payload


def _field_value(line: bytes) -> bytes:
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value
