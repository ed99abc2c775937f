"""One settings object, assembled from the command line, the environment and a config file.

Each option is declared once, with its parser and help text, in the manner of mitmproxy's
addon options; the CLI flags, the `TRACE_PROXY_<OPTION>` variables and the config-file keys are
all derived from that declaration, so the three can never disagree. Precedence: command line >
environment > config file > default. A bad value raises `ConfigError` naming the option.
"""

# Each `Settings` field's default is `option(...)`, a dataclass `field` built once at import.
# ruff: noqa: RUF009

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from trace_proxy.text.toolparsers import get_parser
from trace_proxy.trajectories.keys import parse_mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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


def _tool_parser(value: Any) -> str:
    name = parse_str(value)
    get_parser(name)
    return name


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


def option(parse: Callable[[Any], Any], default: Any, help: str, **how: Any) -> Any:
    """A `Settings` field that is an option (see `Option`); a list default is copied for each
    `Settings`, as a dataclass field's must be."""
    spec = Option(parse, default, help, **how)
    metadata = {"option": spec}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# The backends a proxy can export to (trace_proxy/exporters/ has a factory for each).
BACKEND_NAMES = ("jsonl", "mlflow", "otlp", "trackio", "weave")


def _backends(value: Any) -> str:
    name = parse_str(value).lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKEND_NAMES)})")
    return name


def _mapping(value: Any) -> str:
    text = parse_str(value)
    parse_mapping(text)  # validate now; the capture stage parses it again when it starts
    return text


@dataclass
class Settings:
    """The resolved configuration of one proxy process. Each field is one option, declared
    once: its type here, its parser, default, help text and commands in `option(...)`;
    `OPTIONS` (the command line, the environment, config files) is read from these fields."""

    # fmt: off
    upstream: list[str] = option(
        parse_upstream, [], "inference server to forward to (repeat for several; "
        "calls of one trajectory stick to one upstream)", multiple=True, metavar="URL")
    register_upstreams: bool = option(
        parse_flag, False, "let holders of --admin-token register "
        "upstreams on the admin port (PUT /upstreams/ID with {\"url\": \"http://IP:PORT\"}); "
        "a request names one with X-Trace-Proxy-Upstream: ID, and only those ids are "
        "reachable (verl's plugin registers its servers this way)", switch=True)
    host: str = option(
        parse_host, "127.0.0.1", "address to listen on (loopback unless told)",
        commands=("serve",))
    port: int = option(
        parse_port, 8100, "port to listen on (0 picks a free one)")
    admin_port: int = option(
        parse_port, 8101, "port of the admin endpoints (/metrics, /health, "
        "/ready) on the same host; 0 picks a free one")
    admin_token: str | None = option(
        parse_str, None, "if set, every admin route that changes state "
        "(POST /rewards) needs 'Authorization: Bearer <token>'", metavar="TOKEN")
    backend: list[str] = option(
        _backends, ["jsonl"], "where closed trajectories go "
        "(comma-separated or repeated)", multiple=True, metavar="NAME",
        commands=("serve", "demo"))
    output: Path = option(
        Path, Path("traces"), "directory of the jsonl store",
        metavar="DIR", commands=("serve", "demo"))
    project: str = option(
        parse_name, "default", "project name of the records",
        commands=("serve", "demo"))
    experiment: str = option(
        parse_name, "default",
        "experiment name when a request does not name one", commands=("serve", "demo"))
    connect_timeout: float = option(
        parse_seconds, 10.0, "seconds to connect to an upstream",
        metavar="SECONDS")
    read_timeout: float | None = option(
        parse_optional_seconds, None, "seconds an upstream may stay silent "
        "mid-response (default: no limit; generations run for minutes)", metavar="SECONDS")
    client_header_timeout: float | None = option(
        parse_optional_seconds, 60.0, "seconds a client may take "
        "to send a request's line and headers, from their first byte (from connecting, for "
        "a connection's first request); then 408 and the connection is closed (off: no "
        "limit)", metavar="SECONDS")
    client_body_timeout: float | None = option(
        parse_optional_seconds, 300.0, "seconds a client may take "
        "to send a request's body once its headers are in; then 408 and the connection is "
        "closed (off: no limit). Responses are never timed: they stream for as long as the "
        "upstream generates", metavar="SECONDS")
    max_header_size: int = option(
        parse_size, 8190, "longest request line or header line, in "
        "bytes; a longer one is answered 431 and not forwarded", metavar="SIZE")
    max_headers: int = option(
        parse_count, 128, "most header lines in a request; more are "
        "answered 431 and not forwarded", metavar="N")
    idle_timeout: float = option(
        parse_seconds, 300.0,
        "close a trajectory after this many seconds without a call", metavar="SECONDS")
    step_close_grace: float | None = option(
        parse_optional_seconds, 5.0, "when a later step starts, close "
        "the earlier step's trajectories once idle this long (asynchronous rollouts can "
        "outlive a weight update; 0: at once)", metavar="SECONDS")
    shutdown_grace: float = option(
        parse_seconds, 30.0, "on SIGTERM/SIGINT, seconds to let in-flight "
        "requests finish before records are flushed, and then for the backends to catch up; "
        "helper processes whose proxy was killed finish within it", metavar="SECONDS")
    lifeline_fd: int | None = option(
        parse_optional_count, None, "the read end of a pipe the process that "
        "started the proxy holds the write end of (inherited descriptor number): when it "
        "reads end of file, that process has ended however it ended, and the proxy stops as "
        "on SIGTERM, gone within twice --shutdown-grace and 10 s more",
        metavar="FD", commands=("serve",))
    map: list[str] = option(
        _mapping, ["header:X-Session-ID=trajectory_id"],
        "take a key field from what clients already send: SOURCE:NAME=FIELD or "
        "SOURCE:NAME=/REGEX with named groups/; SOURCE is header or body; or "
        "path:strip=/REGEX/ (a key in the URL path, removed before forwarding) or "
        "path:keep=/REGEX/ (forwarded as it came) (repeatable)",
        multiple=True, metavar="RULE")
    token2text: bool = option(
        parse_flag, False, "decode token ids to text (prompt_text, "
        "response_text, transcript) for recorded trajectories, off the forwarding path",
        switch=True, commands=("serve", "demo", "recover"))
    tokenizer: list[str] = option(
        parse_tokenizer, [], "tokenizer for token2text: a local path or a name "
        "in the Hugging Face cache, or MODEL=PATH per served model (repeatable; default: ask "
        "the upstream for its model path)", multiple=True, metavar="PATH",
        commands=("serve", "demo", "recover"))
    skip_special_tokens: bool = option(
        parse_flag, False, "drop special tokens from decoded text "
        "(kept by default, as verl does)", switch=True, commands=("serve", "demo", "recover"))
    drift_check: bool = option(
        parse_flag, True, "with token2text, mark calls whose token ids drift: the next "
        "prompt leaves their prompt and response ids, or their response ids do not encode "
        "back from their text (costs an encode of each response)",
        commands=("serve", "demo", "recover"))
    tool_parser: str = option(
        _tool_parser, "hermes", "how tool calls are written in decoded text: "
        "hermes (Qwen2.5/Qwen3), qwen3_coder or gpt_oss", metavar="NAME",
        commands=("serve", "demo", "recover"))
    tool_route: list[str] = option(
        parse_tool_route, [], "forward /PREFIX/... to an HTTP tool server and "
        "record each call as a tool span: PREFIX=URL (repeatable)", multiple=True,
        metavar="PREFIX=URL")
    max_samples_per_step: int | None = option(
        parse_optional_count, None, "keep the N samples of each "
        "training step with the smallest keyed hash, with all their rollouts (none: keep all; "
        "0: none)", metavar="N")
    sample_rate: float | None = option(
        parse_optional_fraction, None, "keep a sample when its keyed hash is "
        "below P (no buffering; instead of --max-samples-per-step)", metavar="P")
    validate_max_samples_per_step: int | None = option(
        parse_optional_count, None,
        "--max-samples-per-step for validation steps", metavar="N")
    validate_sample_rate: float | None = option(
        parse_optional_fraction, None,
        "--sample-rate for validation steps", metavar="P")
    sample_seed: int = option(
        parse_int, 0, "key of the sampling hash: the same seed keeps the same "
        "samples on every replica and after a restart", metavar="S")
    otlp_endpoint: str = option(
        parse_upstream, "http://127.0.0.1:4318/v1/traces", "OTLP/HTTP "
        "traces endpoint of the otlp backend", metavar="URL", commands=("serve", "demo"))
    otlp_header: list[str] = option(
        parse_str, [], "header sent with every OTLP export, NAME=VALUE "
        "(repeatable; e.g. authorization)", multiple=True, metavar="NAME=VALUE",
        commands=("serve", "demo"))
    mlflow_tracking_uri: str | None = option(
        parse_str, None, "tracking URI of the mlflow backend (default: "
        "MLFLOW_TRACKING_URI, else sqlite under --output)", metavar="URI",
        commands=("serve", "demo"))
    mlflow_run: str | None = option(
        parse_str, None, "MLflow run the traces are linked to: a run id, or a "
        "run name found or created in the experiment (default: the experiment name)",
        metavar="RUN", commands=("serve", "demo"))
    trackio_dir: Path | None = option(
        Path, None, "where the trackio backend keeps its database (default: "
        "TRACKIO_DIR, else trackio's own default)", metavar="DIR", commands=("serve", "demo"))
    weave_entity: str | None = option(
        parse_str, None, "W&B entity the weave backend logs to, in the Weave "
        "project named by --project (default: WANDB_ENTITY; the key is WANDB_API_KEY)",
        metavar="ENTITY", commands=("serve", "demo"))
    capture_mode: str = option(
        parse_process_mode, "process", "parse and assemble in a process of "
        "their own (process), so forwarding never waits behind a long prompt's parsing, or "
        "in the proxy's (inline)", metavar="MODE", commands=("serve", "demo"))
    capture_priority: str = option(
        parse_priority, "low", "CPU priority of the capture "
        "process: low (nice 19: forwarding has the cores first; while they are saturated "
        "the backlog grows to --capture-queue-bytes, then on disk to "
        "--capture-overflow-bytes, then exchanges are counted as dropped), "
        "normal (recording keeps up on saturated cores, at a cost to forwarding's latency "
        "and throughput) or idle", metavar="PRIORITY", commands=("serve", "demo"))
    capture_queue: int = option(
        parse_int, 10000, "exchanges waiting to be parsed (inline: before "
        "new ones are counted as dropped; in the capture process: before it stops reading)",
        metavar="N")
    capture_max_body: int = option(
        parse_size, 128 << 20, "request and response body bytes of one "
        "exchange kept for recording; past it the call is recorded without its bodies, as "
        "unparsed with the reason (the bytes are forwarded all the same)", metavar="SIZE")
    capture_queue_bytes: int = option(
        parse_size, 512 << 20, "bytes of request and response bodies "
        "waiting to be parsed in memory before new exchanges wait on disk (see "
        "capture_overflow_bytes), then are counted as dropped "
        "(capture_queue_bytes; with a capture process, half wait in the proxy's buffer and "
        "half in its queue); bounds memory when prompts are long", metavar="SIZE")
    capture_overflow_bytes: int = option(
        parse_size, 2 << 30, "disk budget, in the spool's "
        "directory, for exchanges the capture process cannot hold in its queue while parsing "
        "is behind: they wait there in order and are parsed as the load eases, instead of "
        "being dropped; past it the backlog waits in the proxy's buffer, then is dropped and "
        "counted (0: never on disk)", metavar="SIZE", commands=("serve", "demo"))
    spool_dir: Path | None = option(
        Path, None, "where closed trajectories wait on disk until every backend "
        "has them (default: OUTPUT/.spool)", metavar="DIR", commands=("serve", "demo"))
    spool_max_bytes: int = option(
        parse_size, 1 << 30, "disk budget of the spool; past it the "
        "oldest records are deleted and counted as dropped (spool_full) for the backends that "
        "did not have them yet", metavar="SIZE", commands=("serve", "demo"))
    spool_fsync: float = option(
        parse_seconds, 1.0, "at most this many seconds of spooled records "
        "can be lost to a power failure (a process crash loses none)", metavar="SECONDS")
    export_queue: int = option(
        parse_int, 10000, "records kept in memory while the spool cannot "
        "take them, before new ones are counted as dropped", metavar="N")
    export_mode: str = option(
        parse_process_mode, "process", "run the exporters in their own process "
        "(process), so they never take CPU time from forwarding, or in the proxy's (inline)",
        metavar="MODE", commands=("serve", "demo"))
    export_priority: str = option(
        parse_priority, "idle", "CPU priority of the export "
        "process's work: idle (only CPU time nothing else wants: exporting never slows "
        "forwarding, but waits while the cores are saturated), low (nice 19) or normal; "
        "from SIGTERM on it exports at the proxy's priority", metavar="PRIORITY",
        commands=("serve", "demo"))
    log_level: str = option(
        parse_log_level, "INFO", "debug, info, warning or error",
        metavar="LEVEL", commands=("serve", "demo"))
    # fmt: on

    @property
    def spool_path(self) -> Path:
        """Where the spool is: --spool-dir, else beside the store (OUTPUT/.spool)."""
        return self.spool_dir or self.output / ".spool"

    @property
    def uses_tokenizers(self) -> bool:
        """Whether tokenizers are loaded at all: to decode (--token2text), or named for
        telling rollouts apart (--tokenizer)."""
        return self.token2text or bool(self.tokenizer)


OPTIONS: tuple[Option, ...] = tuple(
    replace(f.metadata["option"], name=f.name) for f in fields(Settings)
)
OPTIONS_BY_NAME = {opt.name: opt for opt in OPTIONS}


def values_may_start_with_dash(argv: Sequence[str]) -> list[str]:
    """`--option VALUE` as `--option=VALUE` where VALUE begins with `-` (a token from
    `secrets.token_urlsafe` may), which argparse would take for another option."""
    takes_value = {opt.flag for opt in OPTIONS if not opt.switch} | {"--config"}
    known = {opt.flag for opt in OPTIONS} | {"--config", "-h", "--help"}
    joined: list[str] = []
    items = iter(argv)
    for item in items:
        if item in takes_value:
            value = next(items, None)
            if value is None:
                joined.append(item)
            elif value.startswith("-") and value not in known:
                joined.append(f"{item}={value}")
            else:
                joined += [item, value]
            continue
        joined.append(item)
    return joined


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Register every option of `command` on an argparse parser (defaults resolved later)."""
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        default = opt.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        help_text = f"{opt.help} [env {opt.env}; default: {shown if shown != [] else 'none'}]"
        if opt.switch:
            parser.add_argument(
                opt.flag, dest=opt.name, action="store_const", const=True,
                default=argparse.SUPPRESS, help=help_text,
            )  # fmt: skip
            continue
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            action="append" if opt.multiple else "store",
            default=argparse.SUPPRESS,
            metavar=opt.metavar or opt.name.upper(),
            help=help_text,
        )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"YAML or TOML file with any of these options [env {ENV_PREFIX}CONFIG]",
    )


def resolve(
    command: str,
    cli: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge command line > environment > config file > defaults into a Settings."""
    environ = os.environ if environ is None else environ
    config_path = cli.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    from_file = load_config_file(Path(config_path), command) if config_path else {}
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        if opt.name in cli:
            raw, where = cli[opt.name], opt.flag
        elif opt.env in environ:
            raw, where = environ[opt.env], opt.env
        elif opt.name in from_file:
            raw, where = from_file[opt.name], f"{opt.name} in {config_path}"
        else:
            continue
        values[opt.name] = _parse(opt, raw, where)
    settings = Settings(**values)
    if settings.register_upstreams and settings.admin_token is None:
        raise ConfigError(
            "invalid value for --register-upstreams: it needs --admin-token (whoever can "
            "register an upstream decides where the proxy connects)"
        )
    for prefix in ("", "validate_"):
        if (
            getattr(settings, prefix + "max_samples_per_step") is not None
            and getattr(settings, prefix + "sample_rate") is not None
        ):
            flag = "--" + prefix.replace("_", "-")
            raise ConfigError(
                f"invalid value for {flag}sample-rate: choose either {flag}max-samples-per-step "
                f"or {flag}sample-rate"
            )
    return settings


def _parse(opt: Option, raw: Any, where: str) -> Any:
    items: Iterable[Any]
    if opt.multiple:
        if isinstance(raw, str):
            items = [raw]
        elif isinstance(raw, Sequence):
            items = raw
        else:
            raise ConfigError(f"invalid value for {where}: expected a list")
        # A comma-separated value is a list too, except for rules that may hold commas.
        whole = opt.name in ("map", "tokenizer", "otlp_header")  # values that may hold commas
        split = [p for it in items for p in ([it] if whole else _split_commas(it))]
        try:
            return [opt.parse(p) for p in split]
        except ValueError as exc:
            raise ConfigError(f"invalid value for {where}: {exc}") from None
    try:
        return opt.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"invalid value for {where}: {exc}") from None


def _split_commas(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [value]


# verl's names for the same settings (actor_rollout_ref.rollout.trace.*), accepted in files.
VERL_ALIASES = {
    "project_name": "project",
    "experiment_name": "experiment",
    "max_samples_per_step_per_worker": "max_samples_per_step",
}


def load_config_file(path: Path, command: str) -> dict[str, Any]:
    """Read a YAML or TOML file into option values; unknown keys are an error, not a no-op."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"invalid value for --config: cannot read {path}: {exc.strerror}"
        ) from None
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(text.decode("utf-8"))
        else:
            data = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"invalid value for --config: {path} is not valid: {first_line}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid value for --config: {path} must hold a mapping of options")
    if isinstance(data.get("trace"), dict):  # verl's `trace:` block
        data = {**{k: v for k, v in data.items() if k != "trace"}, **data["trace"]}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = VERL_ALIASES.get(str(key), str(key).replace("-", "_"))
        opt = OPTIONS_BY_NAME.get(name)
        if opt is None or command not in opt.commands:
            raise ConfigError(f"invalid value for --config: unknown option {key!r} in {path}")
        values[name] = value
    return values
