"""What the plugin reads from verl's config: `trace_proxy.*` keys and verl's own trace block.

verl's `actor_rollout_ref.rollout.trace.*` keeps its meaning: `backend` (mlflow, weave,
trackio), `token2text`, `project_name`, `experiment_name`, and
`max_samples_per_step_per_worker` (N samples per agent-loop worker and step: N x
`agent.num_workers` samples of each step are kept, whole GRPO groups, chosen once for the
whole step). A `trace_proxy.*` key, when given, wins over verl's. Text is decoded (token2text:
readable calls, and tool calls parsed into tool spans) whenever the model's tokenizer is a
local directory, unless the user said otherwise: `trace_proxy.token2text`, or verl's
`trace.token2text` at a value other than verl's own default (verl ships `false`, and its
composed config keeps no record of who set a value, so verl's `false` cannot say "off").
Reads a mapping and verl's shipped rollout.yaml; imports no verl.

A key that sets a proxy option is named as the option (`PROXY_OPTIONS`); the proxies' command
line takes its flags from the option table, and the plugin's own view of their settings
(`PluginSettings.proxy_settings`, for the step's sampling) is resolved from the same values.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trace_proxy.commandline import UsageParser
from trace_proxy.config import (
    OPTIONS_BY_NAME,
    Settings,
    add_options,
    resolve,
    values_may_start_with_dash,
)

TOKEN_ENV = "TRACE_PROXY_ADMIN_TOKEN"
# The `trace_proxy.*` keys that set an option of each proxy the plugin starts: the option's name.
PROXY_OPTIONS = (
    "backend", "max_samples_per_step", "sample_rate", "validate_max_samples_per_step",
    "validate_sample_rate", "sample_seed", "mlflow_tracking_uri", "trackio_dir",
    "weave_entity", "otlp_endpoint", "tool_parser", "log_level",
)  # fmt: skip
PLUGIN_KEYS = frozenset(
    {"url", "admin_url", "manager", "token2text", "tokenizer", "start_timeout", "args",
     "output", "host"}
)  # fmt: skip
VERL_BACKENDS = {"mlflow": "mlflow", "weave": "weave", "trackio": "trackio"}
# The file verl composes `actor_rollout_ref.rollout` from, inside its package.
VERL_ROLLOUT_YAML = ("trainer", "config", "rollout", "rollout.yaml")


class PluginConfigError(ValueError):
    """A `trace_proxy.*` key (or verl trace setting) the plugin cannot honour."""


@dataclass(frozen=True)
class PluginSettings:
    """Where the proxy is, and how a proxy the plugin starts is configured."""

    project: str
    experiment: str
    url: str | None = None  # a running proxy (sidecar); None: the plugin starts one
    admin_url: str | None = None
    admin_token: str | None = None
    manager: str = "auto"  # auto (verl's trainer.use_v1) | v1 | legacy
    start_timeout: float = 120.0
    # The options of each proxy the plugin starts, but --output and --host, as its command
    # line gives them: a str, a list of str (a repeatable option) or True (a switch)...
    proxy_options: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)  # ...then `trace_proxy.args`, as given
    output: str = "traces"  # each node's proxy writes <output>/replicas/<node>
    host: str | None = None  # where the proxies listen; None: where verl's servers do

    @property
    def proxy_args(self) -> list[str]:
        """The command line of each proxy the plugin starts, but --output and --host."""
        args: list[str] = []
        for name, value in self.proxy_options.items():
            flag = OPTIONS_BY_NAME[name].flag
            if value is True:
                args.append(flag)
                continue
            args += [part for item in _listed(value) for part in (flag, item)]
        return args + self.extra_args

    def proxy_settings(self) -> Settings:
        """The settings each proxy the plugin starts resolves (`trace_proxy.args`, its
        environment and a config file taken as the proxy takes them)."""
        given = dict(self.proxy_options)
        if self.extra_args:
            parser = UsageParser(prog="trace-proxy serve")
            add_options(parser, "serve")
            parsed = vars(parser.parse_args(values_may_start_with_dash(self.extra_args)))
            for name, value in parsed.items():  # a repeatable option adds up, as on a command line
                earlier = given.get(name)
                given[name] = earlier + value if isinstance(earlier, list) else value
        return resolve("serve", given)


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if isinstance(node, Mapping) or hasattr(node, "get") else None
        except Exception:  # an OmegaConf interpolation that cannot be resolved
            return default
    return default if node is None else node


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def read_settings(config: Any, verl_defaults: Mapping[str, Any] | None = None) -> PluginSettings:
    """The plugin's settings from verl's whole config (a DictConfig or a plain mapping).

    `verl_defaults`: verl's own `actor_rollout_ref.rollout.trace` values, which are verl's and
    not the user's choice; by default read from the installed verl (`verl_trace_defaults`)."""
    if verl_defaults is None:
        verl_defaults = verl_trace_defaults()
    ours = _get(config, "trace_proxy", {}) or {}
    ours = {str(k): v for k, v in ours.items()}
    unknown = set(ours) - set(PROXY_OPTIONS) - PLUGIN_KEYS
    if unknown:
        raise PluginConfigError(
            f"unknown trace_proxy key(s): {', '.join(sorted(unknown))} (known: "
            f"{', '.join(sorted(set(PROXY_OPTIONS) | PLUGIN_KEYS))})"
        )
    trace = _get(config, "actor_rollout_ref.rollout.trace", {}) or {}
    project = str(trace.get("project_name") or _get(config, "trainer.project_name") or "default")
    experiment = str(
        trace.get("experiment_name") or _get(config, "trainer.experiment_name") or "default"
    )
    manager = str(ours.get("manager", "auto"))
    if manager not in ("auto", "v1", "legacy"):
        raise PluginConfigError(f"trace_proxy.manager must be auto, v1 or legacy, not {manager!r}")
    options = dict(ours)
    verl_backend = trace.get("backend")
    if "backend" not in options and verl_backend:
        if str(verl_backend) not in VERL_BACKENDS:
            raise PluginConfigError(
                f"actor_rollout_ref.rollout.trace.backend={verl_backend!r} has no trace-proxy "
                f"backend (known: {', '.join(VERL_BACKENDS)})"
            )
        options["backend"] = ["jsonl", VERL_BACKENDS[str(verl_backend)]]
    per_worker = trace.get("max_samples_per_step_per_worker")
    if "max_samples_per_step" not in options and per_worker is not None:
        workers = int(_get(config, "actor_rollout_ref.rollout.agent.num_workers", 1) or 1)
        options["max_samples_per_step"] = int(per_worker) * workers
    proxy_options: dict[str, Any] = {}
    for name in PROXY_OPTIONS:
        value = options.get(name)
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple)) or _is_sequence(value) else [value]
        given = [str(item) for item in values]  # a list: as the flag repeated, a value each
        if given:
            proxy_options[name] = given if OPTIONS_BY_NAME[name].multiple else given[-1]
    tokenizer = ours.get("tokenizer") or _local_tokenizer(config)
    token2text = _chosen_token2text(ours, trace, verl_defaults)
    if token2text if token2text is not None else bool(tokenizer):
        proxy_options["token2text"] = True
        if tokenizer:
            proxy_options["tokenizer"] = [str(tokenizer)]
    extra = ours.get("args") or []
    url = ours.get("url")
    admin_url = ours.get("admin_url")
    if url and not admin_url:
        raise PluginConfigError(
            "trace_proxy.url names a running proxy: give its trace_proxy.admin_url too "
            f"(and its token in ${TOKEN_ENV})"
        )
    return PluginSettings(
        project=project,
        experiment=experiment,
        url=str(url).rstrip("/") if url else None,
        admin_url=str(admin_url).rstrip("/") if admin_url else None,
        admin_token=os.environ.get(TOKEN_ENV) if url else None,
        manager=manager,
        start_timeout=float(ours.get("start_timeout", 120.0)),
        proxy_options=proxy_options,
        extra_args=[str(item) for item in (extra if _is_sequence(extra) else [extra])],
        output=str(ours.get("output") or "traces"),
        host=str(ours["host"]) if ours.get("host") else None,
    )


def _listed(value: str | list[str]) -> list[str]:
    return value if isinstance(value, list) else [value]


def _is_sequence(value: Any) -> bool:
    return (
        not isinstance(value, (str, bytes))
        and hasattr(value, "__iter__")
        and not hasattr(value, "items")
    )


def _chosen_token2text(
    ours: Mapping[str, Any], trace: Mapping[str, Any], verl_defaults: Mapping[str, Any]
) -> bool | None:
    """Whether the user turned decoding on or off; None when they did not say.

    `trace_proxy.token2text` always says. verl's `trace.token2text` says only when it differs
    from verl's own default: at the default it is what verl ships, not a choice."""
    if ours.get("token2text") is not None:
        return _flag(ours["token2text"])
    value = trace.get("token2text")
    if value is None:
        return None
    default = verl_defaults.get("token2text")
    if default is not None and _flag(value) == _flag(default):
        return None
    return _flag(value)


def verl_trace_defaults() -> dict[str, Any]:
    """verl's `actor_rollout_ref.rollout.trace` block as the installed verl ships it (its
    rollout.yaml, which every verl trainer config composes); empty without verl."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return {}
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location).joinpath(*VERL_ROLLOUT_YAML)
        try:
            shipped = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        trace = shipped.get("trace") if isinstance(shipped, dict) else None
        if isinstance(trace, dict):
            return {str(key): value for key, value in trace.items()}
    return {}


def _local_tokenizer(config: Any) -> str | None:
    """The model's tokenizer, when verl's config names a local directory."""
    for key in ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path"):
        value = _get(config, key)
        if value and Path(str(value)).expanduser().is_dir():
            return str(Path(str(value)).expanduser())
    return None
