"""Step-level control routes of vLLM and SGLang: weight updates, pause/resume, sleep/wake.

They are recorded as step events: the moment a new policy reaches the server matters for every
trajectory around it. Large bodies (serialised tensors) are summarised, never stored.
"""

from __future__ import annotations

from typing import Any

import orjson

from trace_proxy import safejson
from trace_proxy.capture.dialects.common import exchange_failure
from trace_proxy.capture.exchange import Exchange
from trace_proxy.trajectories.record import StepEvent

EVENTS: dict[str, str] = {
    # vLLM (VLLM_SERVER_DEV_MODE routes)
    "/pause": "pause",
    "/resume": "resume",
    "/sleep": "sleep",
    "/wake_up": "wake_up",
    "/abort_requests": "abort",
    "/reset_prefix_cache": "flush_cache",
    "/init_weight_transfer_engine": "weight_transfer_init",
    "/start_weight_update": "weight_update_start",
    "/update_weights": "weight_update",
    "/finish_weight_update": "weight_update_finish",
    "/update_weight_version": "weight_version",
    # SGLang
    "/pause_generation": "pause",
    "/continue_generation": "resume",
    "/release_memory_occupation": "sleep",
    "/resume_memory_occupation": "wake_up",
    "/abort_request": "abort",
    "/flush_cache": "flush_cache",
    "/init_weights_update_group": "weight_transfer_init",
    "/destroy_weights_update_group": "weight_transfer_destroy",
    "/update_weights_from_disk": "weight_update",
    "/update_weights_from_distributed": "weight_update",
    "/update_weights_from_tensor": "weight_update",
    "/update_weights_from_ipc": "weight_update",
}
MAX_PARAM_CHARS = 256


def parse_event(ex: Exchange, project: str, experiment: str) -> StepEvent:
    event = StepEvent(
        event=EVENTS[ex.path],
        route=ex.path,
        upstream=ex.upstream,
        time=ex.start,
        project=project,
        experiment=experiment,
        http_status=ex.status,
    )
    body: Any = None
    if ex.bodies_skipped is not None:
        event.params = {"unparsed": ex.bodies_skipped}
    elif ex.request_body:
        try:
            body = orjson.loads(ex.request_body)
        except orjson.JSONDecodeError:
            event.params = {"unparsed": f"{len(ex.request_body)} bytes, not JSON"}
    if isinstance(body, dict):
        event.params = _small_params(body)
        version = body.get("weight_version", body.get("new_version"))
        if isinstance(version, (str, int)) and not isinstance(version, bool):
            event.weight_version = str(version)
    event.error = exchange_failure(ex)
    return event


def _small_params(body: dict[str, Any]) -> dict[str, Any]:
    """Scalars and short values as they are; anything large replaced by its size."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if isinstance(value, (bool, int, float)) or value is None:
            params[key] = value
            continue
        text = value if isinstance(value, str) else safejson.dumps(value).decode()
        params[key] = value if len(text) <= MAX_PARAM_CHARS else f"<{len(text)} chars omitted>"
    return params
