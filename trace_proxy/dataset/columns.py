"""What both forms say of a trajectory (its key, outcome and status), and their Parquet schemas.

Columns are fixed and typed, never guessed from the first rows: a null in one file and a number
in the next would give files `datasets` cannot load as one dataset.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from trace_proxy.store.readers import group_name

KEY_FIELDS = [
    pa.field("id", pa.string()),  # the record's id (`trace-proxy show`, the viewer's URLs)
    pa.field("trajectory_id", pa.string()),  # the client's, when it sent one
    pa.field("project", pa.string()),
    pa.field("experiment", pa.string()),
    pa.field("step", pa.int64()),
    pa.field("validate", pa.bool_()),
    pa.field("sample_index", pa.int64()),
    pa.field("rollout_n", pa.int64()),
    pa.field("sample_id", pa.string()),  # the client's id of the sample (verl's `uid`)
    pa.field("group", pa.string()),  # the GRPO group: `sample N`, `hash H` or `trajectory ID`
    pa.field("reward", pa.float64()),  # late rewards merged
    pa.field("score", pa.float64()),
    pa.field("labels", pa.string()),  # JSON text
    pa.field("status", pa.string()),
]

FUNCTION = pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])
TOOL_CALL = pa.struct(
    [pa.field("id", pa.string()), pa.field("type", pa.string()), pa.field("function", FUNCTION)]
)
MESSAGE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("reasoning_content", pa.string()),
        pa.field("tool_calls", pa.list_(TOOL_CALL)),
        pa.field("tool_call_id", pa.string()),
        pa.field("name", pa.string()),
        # true: text a token prompt added whose roles no known chat template told (a `user`
        # message holding it as it was written)
        pa.field("unparsed", pa.bool_()),
    ]
)

SFT_SCHEMA = pa.schema(
    [
        *KEY_FIELDS,
        pa.field("turns", pa.int32()),
        pa.field("model", pa.string()),
        pa.field("messages", pa.list_(MESSAGE)),
        pa.field("tools", pa.string()),  # the tools offered, as the request's JSON
        pa.field("text", pa.string()),  # the decoded transcript, when the store has it
    ]
)

RL_SCHEMA = pa.schema(
    [
        *KEY_FIELDS,
        pa.field("turn", pa.int32()),  # the call's index in its trajectory
        pa.field("output", pa.int32()),  # the choice, for calls with n > 1
        pa.field("turns", pa.int32()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("logprobs", pa.list_(pa.float32())),
        pa.field("finish_reason", pa.string()),
        pa.field("weight_version", pa.string()),
        # Asynchronous RL: the version of each attempt of the call (a resumed call has
        # several), how many versions behind the newest at close the call's was, and the
        # trajectory's oldest, newest and newest-seen versions (docs/record-schema.md).
        pa.field("weight_versions", pa.list_(pa.string())),
        pa.field("version_lag", pa.int64()),
        pa.field("weight_version_min", pa.string()),
        pa.field("weight_version_max", pa.string()),
        pa.field("weight_version_latest", pa.string()),
        pa.field("partial_rollout", pa.bool_()),
        pa.field("model", pa.string()),
        pa.field("ids_from", pa.string()),  # `record`, `tokenizer`, or null: not known
    ]
)


def key_columns(record: dict[str, Any]) -> dict[str, Any]:
    """The key, outcome and status columns of a trajectory record."""
    key = record.get("key") or {}
    labels = record.get("labels")
    return {
        "id": text_or_none(record.get("id")),
        "trajectory_id": text_or_none(key.get("trajectory_id")),
        "project": text_or_none(key.get("project")),
        "experiment": text_or_none(key.get("experiment")),
        "step": _integer(key.get("step")),
        "validate": bool(key.get("validate")),
        "sample_index": _integer(key.get("sample_index")),
        "rollout_n": _integer(key.get("rollout_n")),
        "sample_id": text_or_none(key.get("sample_id")),
        "group": group_name(key, str(record.get("id"))),
        "reward": _number(record.get("reward")),
        "score": _number(record.get("score")),
        "labels": json.dumps(labels, ensure_ascii=False) if labels else None,
        "status": text_or_none(record.get("status")),
    }


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def text_or_none(value: Any) -> str | None:
    """A record's value as a string column (null stays null)."""
    return None if value is None else str(value)
