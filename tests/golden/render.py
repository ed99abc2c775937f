"""Each backend's rendering of the golden records, as the backend would send or store it:
MLflow's trace records and trackio's messages, spans and metadata (their pure renderers), the
OpenTelemetry spans the SDK hands its exporter, and the calls Weave's client sends a server
(the fake of tests/fakes/weave_server.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from trace_proxy.trajectories.record import Annotation, Record, Trajectory, loads

os.environ.setdefault("WANDB_ERROR_REPORTING", "false")


def as_records(stored: list[dict[str, Any]]) -> list[Record]:
    records = []
    for item in stored:
        data = {k: v for k, v in item.items() if k not in ("proxy", "file")}
        records.append(loads(orjson.dumps(data)))
    return records


def mlflow_traces(records: list[Record]) -> list[Any]:
    from trace_proxy.exporters.backends.mlflow_traces import outcome_tags, render

    rendered: list[Any] = []
    for record in records:
        if isinstance(record, Trajectory):
            rendered.append(dataclasses.asdict(render(record, "run-1")))
        elif isinstance(record, Annotation):
            rendered.append({"annotation_tags": outcome_tags(record.reward, record.score,
                                                             record.labels)})  # fmt: skip
    return rendered


def trackio_items(stored: list[dict[str, Any]]) -> list[Any]:
    from trace_proxy.exporters.backends.trackio import annotation_metadata, render_trajectory

    rendered: list[Any] = []
    for data in stored:
        if data.get("record") == "trajectory":
            messages, spans, metadata = render_trajectory(data)
            rendered.append({"messages": messages, "spans": spans, "metadata": metadata})
        elif data.get("record") == "annotation":
            rendered.append(annotation_metadata(data))
    return rendered


def otlp_spans(records: list[Record]) -> list[Any]:
    from trace_proxy.exporters.backends.otlp import OtlpExporter

    memory = InMemorySpanExporter()
    exporter = OtlpExporter("http://127.0.0.1:9/v1/traces", {}, span_exporter=memory)
    exporter.export(records)
    exporter.close()
    return [
        {
            "name": span.name,
            "kind": span.kind.name,
            "trace_id": f"{span.context.trace_id:032x}",
            "span_id": f"{span.context.span_id:016x}",
            "parent": f"{span.parent.span_id:016x}" if span.parent else None,
            "start": span.start_time,
            "end": span.end_time,
            "status": [span.status.status_code.name, span.status.description],
            "attributes": dict(span.attributes or {}),
            "events": [
                {"name": e.name, "time": e.timestamp, "attributes": dict(e.attributes or {})}
                for e in span.events
            ],
            "resource": dict(span.resource.attributes),
        }
        for span in memory.get_finished_spans()
    ]


async def weave_calls(records: list[Record]) -> list[Any]:
    from fakes.weave_server import FakeWeaveServer

    from trace_proxy.exporters.backends.weave import WeaveExporter

    server = FakeWeaveServer()
    async with server.serve() as url:
        exporter = WeaveExporter("ent", "proj", server_url=url, api_key="k" * 40)
        await asyncio.wait_for(asyncio.to_thread(exporter.export, records), 60)
        await asyncio.to_thread(exporter.close)
    return [orjson.loads(orjson.dumps(call, default=str)) for call in server.calls]


async def backend_renderings(stored: list[dict[str, Any]]) -> dict[str, list[Any]]:
    records = as_records(stored)
    return {
        "mlflow": mlflow_traces(records),
        "trackio": trackio_items(stored),
        "otlp": otlp_spans(records),
        "weave": await weave_calls(records),
    }
