"""What an option is (`Option`: parser, default, help, commands) and how a value is read.

The floor the option table stands on: config.py declares most options and assembles them all
into one (`OPTIONS`); the backends' options are declared beside the backend table
(exporters/options.py), which imports this and not config. A parser takes the raw value (a
str from the command line or the environment, anything from a file) and raises ValueError
saying what is wrong; `ConfigError` then names the option.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "TRACE_PROXY_"


class ConfigError(ValueError):
    """An option with an invalid value; the message names the option."""


# --- value parsers: each takes the raw value (str from CLI/env, any from a file) ---------------


def parse_str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def parse_port(value: Any) -> int:
    port = parse_int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port (0-65535)")
    return port


def parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not an integer") from None


def parse_seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if seconds <= 0 or seconds != seconds:
        raise ValueError("must be a positive number of seconds")
    return seconds


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes: 1073741824, 512MiB, 512M, 2GB, 1.5G (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
    if match is None or isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size (e.g. 1073741824, 512MiB, 2GiB)")
    size = int(float(match[1]) * _SIZE_UNITS[match[2]])
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


def parse_process_mode(value: Any) -> str:
    mode = parse_str(value).lower()
    if mode not in ("process", "inline"):
        raise ValueError(f"{value!r} is not one of: process, inline")
    return mode


def parse_priority(value: Any) -> str:
    priority = parse_str(value).lower()
    if priority not in ("idle", "low", "normal"):
        raise ValueError(f"{value!r} is not one of: idle, low, normal")
    return priority


def parse_optional_seconds(value: Any) -> float | None:
    """Seconds, or none/off/0 for 'no limit' (generations can run for minutes)."""
    if value is None or (isinstance(value, str) and value.lower() in ("", "none", "off", "0")):
        return None
    if value == 0:
        return None
    return parse_seconds(value)


def parse_host(value: Any) -> str:
    host = parse_str(value)
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
                raise ValueError(f"{host!r} is not a host name or IP address") from None
    return host


# An upstream URL is printable ASCII without spaces, and its path is made of RFC 3986's path
# characters only: `urlsplit` silently drops CR, LF and tabs, and anything else would reach
# the upstream's request line as it is.
_PLAIN_URL = re.compile(r"(https?)://([^/?#]+)((?:/[A-Za-z0-9\-._~!$&'()*+,;=:@%]*)*)")


def plain_url(value: str) -> str:
    """`value` without a trailing slash, when it is an http(s)://host[:port][/path] URL of
    plain characters (as above); else ValueError, saying what is wrong."""
    url = value.rstrip("/")
    if not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError(
            f"{value[:200]!r}: an upstream URL is printable ASCII, with no space or control "
            "character (percent-encode the rest)"
        )
    if not _PLAIN_URL.fullmatch(url):
        raise ValueError(
            f"{value[:200]!r} is not an http(s)://host[:port][/path] URL whose path holds only "
            "letters, digits, '%' escapes and -._~!$&'()*+,;=:@/"
        )
    return url


def parse_upstream(value: Any) -> str:
    """An absolute http(s) URL with a host and a plain path (`plain_url`), no credentials; a
    trailing slash is dropped."""
    url = plain_url(parse_str(value))
    if "@" in url.partition("://")[2].partition("/")[0]:
        raise ValueError("credentials do not belong in an upstream URL")
    return url


def parse_flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{value!r} is not true or false")


def parse_tokenizer(value: Any) -> str:
    """`PATH_OR_NAME`, or `MODEL=PATH_OR_NAME` when several models are served."""
    text = parse_str(value)
    model, eq, source = text.partition("=")
    if eq and (not model or not source):
        raise ValueError(f"{text!r} is not PATH or MODEL=PATH")
    return text


def parse_tool_route(value: Any) -> str:
    """`PREFIX=URL`: requests to /PREFIX/... go to that tool server."""
    text = parse_str(value)
    prefix, eq, url = text.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z0-9._-]+", prefix):
        raise ValueError(f"{text!r} is not PREFIX=URL with a simple PREFIX (letters, digits, ._-)")
    return f"{prefix}={parse_upstream(url)}"


def parse_count(value: Any) -> int:
    count = parse_int(value)
    if count <= 0:
        raise ValueError("must be 1 or more")
    return count


def parse_optional_count(value: Any) -> int | None:
    """A count, or none/null for 'no limit'."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    count = parse_int(value)
    if count < 0:
        raise ValueError("must be 0 or more (or none)")
    return count


def parse_optional_fraction(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("must be a fraction between 0 and 1")
    return fraction


def parse_log_level(value: Any) -> str:
    level = parse_str(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"{value!r} is not one of debug, info, warning, error")
    return level


def parse_name(value: Any) -> str:
    name = parse_str(value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name):
        raise ValueError(f"{name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return name


@dataclass(frozen=True)
class Option:
    """One setting: its name (snake_case, the `Settings` field's), parser, default and help."""

    parse: Callable[[Any], Any]
    default: Any
    help: str
    multiple: bool = False  # a list: repeat the flag, or comma-separate in env/file
    switch: bool = False  # `--name` alone turns it on
    metavar: str | None = None
    commands: tuple[str, ...] = ("serve",)
    name: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()
