"""Backends that closed trajectories are exported to. Adding one = a module, a line here, and
its name and options in `options.py`.

Each backend takes a small config of its own (what it needs of the options), built here from
the resolved settings (`BackendSettings`: config's `Settings` is one): this is where options
and exporters meet, so nothing in exporters/ imports config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trace_proxy.exporters.base import Exporter
from trace_proxy.options import ConfigError


class BackendSettings(Protocol):
    """What the backend table reads of the resolved settings."""

    backend: list[str]
    output: Path
    project: str
    tool_parser: str
    otlp_endpoint: str
    otlp_header: list[str]
    mlflow_tracking_uri: str | None
    mlflow_run: str | None
    trackio_dir: Path | None
    weave_entity: str | None


ExporterFactory = Callable[[BackendSettings], Exporter]


def _jsonl(settings: BackendSettings) -> Exporter:
    from trace_proxy.exporters.backends.jsonl import JsonlExporter

    return JsonlExporter(settings.output)


def _trackio(settings: BackendSettings) -> Exporter:
    from trace_proxy.exporters.backends.trackio import TrackioConfig, create

    return create(
        TrackioConfig(
            project=settings.project,
            directory=settings.trackio_dir,
            tool_parser=settings.tool_parser,
        )
    )


def _otlp(settings: BackendSettings) -> Exporter:
    from trace_proxy.exporters.backends.otlp import OtlpConfig, create

    return create(OtlpConfig(endpoint=settings.otlp_endpoint, headers=tuple(settings.otlp_header)))


def _mlflow(settings: BackendSettings) -> Exporter:
    from trace_proxy.exporters.backends.mlflow import MlflowConfig, create

    return create(
        MlflowConfig(
            tracking_uri=settings.mlflow_tracking_uri,
            output=settings.output,
            project=settings.project,
            run=settings.mlflow_run,
        )
    )


def _weave(settings: BackendSettings) -> Exporter:
    from trace_proxy.exporters.backends.weave import WeaveConfig, create

    return create(WeaveConfig(entity=settings.weave_entity, project=settings.project))


BACKENDS: dict[str, ExporterFactory] = {
    "jsonl": _jsonl,
    "trackio": _trackio,
    "otlp": _otlp,
    "mlflow": _mlflow,
    "weave": _weave,
}


def create_exporters(settings: BackendSettings) -> list[Exporter]:
    """One exporter per named backend; a backend that cannot start is a ConfigError."""
    exporters = []
    for name in dict.fromkeys(settings.backend):
        try:
            exporters.append(BACKENDS[name](settings))
        except ImportError as exc:
            raise ConfigError(
                f"invalid value for --backend: {name} needs its extra, "
                f"pip install 'trace-proxy[{name}]' ({exc})"
            ) from None
        except (RuntimeError, ValueError, OSError) as exc:
            raise ConfigError(f"invalid value for --backend: {name} cannot start: {exc}") from None
    return exporters
