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
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TOKEN_ENV = "TRACE_PROXY_ADMIN_TOKEN"
# Keys of `trace_proxy.*` with the proxy option each sets, for a proxy the plugin starts.
PROXY_OPTIONS = {
    "backend": "--backend",
    "max_samples_per_step": "--max-samples-per-step",
    "sample_rate": "--sample-rate",
    "validate_max_samples_per_step": "--validate-max-samples-per-step",
    "validate_sample_rate": "--validate-sample-rate",
    "sample_seed": "--sample-seed",
    "mlflow_tracking_uri": "--mlflow-tracking-uri",
    "trackio_dir": "--trackio-dir",
    "weave_entity": "--weave-entity",
    "otlp_endpoint": "--otlp-endpoint",
    "tool_parser": "--tool-parser",
    "log_level": "--log-level",
}
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
    proxy_args: list[str] = field(default_factory=list)  # all but --output and --host
    output: str = "traces"  # each node's proxy writes <output>/replicas/<node>
    host: str | None = None  # where the proxies listen; None: where verl's servers do


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
    args: list[str] = []
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
    for key, flag in PROXY_OPTIONS.items():
        value = options.get(key)
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple)) or _is_sequence(value) else [value]
        args += [part for item in values for part in (flag, str(item))]
    tokenizer = ours.get("tokenizer") or _local_tokenizer(config)
    token2text = _chosen_token2text(ours, trace, verl_defaults)
    if token2text if token2text is not None else bool(tokenizer):
        args.append("--token2text")
        if tokenizer:
            args += ["--tokenizer", str(tokenizer)]
    extra = ours.get("args") or []
    args += [str(item) for item in (extra if _is_sequence(extra) else [extra])]
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
        proxy_args=args,
        output=str(ours.get("output") or "traces"),
        host=str(ours["host"]) if ours.get("host") else None,
    )


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
