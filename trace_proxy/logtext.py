"""Text from outside (a request's path, a registered URL, a model's output) made safe to print.

A log line or a terminal line must be one line that says what the proxy means: a decoded
`%0a` in a path would start a forged log line, an escape sequence would drive the terminal.
"""

from __future__ import annotations

import logging


def printable(text: str) -> str:
    """`text` with every character a terminal could act on (C0 and C1 controls, DEL, bidi
    overrides, line separators, lone surrogates: all `str.isprintable` refuses) written as an
    escape, the way `repr` writes it (`\\x1b`, `\\n`, `\\u202e`); other text, in any script,
    as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class OneLine(logging.Filter):
    """Every log record's message as one line of printable text: what a request said (a path,
    an id) can then never start a forged line, whatever code logged it. A traceback stays as
    it is (the formatter adds it after the message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = printable(message), None
        return True


def configure_logging(fmt: str, level: str | int = "WARNING") -> None:
    """Log to stderr in `fmt`, every message on one line (`OneLine`); libraries at WARNING,
    the project's own loggers at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(OneLine())
    logging.basicConfig(level="WARNING", handlers=[handler])
    logging.getLogger("trace_proxy").setLevel(level)
