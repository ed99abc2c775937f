"""The backends' names and options, declared beside the backend table (`exporters/__init__.py`
has a factory for each name). config.py places each option among the others in the one option
table, where `--help` lists it; nothing here imports config.

Adding a backend: its module, its name here, a factory in the table, and its options here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_proxy.options import Option, parse_str, parse_upstream

# The backends a proxy can export to.
BACKEND_NAMES = ("jsonl", "mlflow", "otlp", "trackio", "weave")
EXPORTING = ("serve", "demo")  # the commands that export


def parse_backend(value: Any) -> str:
    name = parse_str(value).lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKEND_NAMES)})")
    return name


# fmt: off
BACKEND = Option(
    parse_backend, ["jsonl"], "where closed trajectories go "
    "(comma-separated or repeated)", multiple=True, metavar="NAME", commands=EXPORTING)
OTLP_ENDPOINT = Option(
    parse_upstream, "http://127.0.0.1:4318/v1/traces", "OTLP/HTTP "
    "traces endpoint of the otlp backend", metavar="URL", commands=EXPORTING)
OTLP_HEADER = Option(
    parse_str, [], "header sent with every OTLP export, NAME=VALUE "
    "(repeatable; e.g. authorization)", multiple=True, metavar="NAME=VALUE",
    commands=EXPORTING)
MLFLOW_TRACKING_URI = Option(
    parse_str, None, "tracking URI of the mlflow backend (default: "
    "MLFLOW_TRACKING_URI, else sqlite under --output)", metavar="URI", commands=EXPORTING)
MLFLOW_RUN = Option(
    parse_str, None, "MLflow run the traces are linked to: a run id, or a "
    "run name found or created in the experiment (default: the experiment name)",
    metavar="RUN", commands=EXPORTING)
TRACKIO_DIR = Option(
    Path, None, "where the trackio backend keeps its database (default: "
    "TRACKIO_DIR, else trackio's own default)", metavar="DIR", commands=EXPORTING)
WEAVE_ENTITY = Option(
    parse_str, None, "W&B entity the weave backend logs to, in the Weave "
    "project named by --project (default: WANDB_ENTITY; the key is WANDB_API_KEY)",
    metavar="ENTITY", commands=EXPORTING)
# fmt: on
