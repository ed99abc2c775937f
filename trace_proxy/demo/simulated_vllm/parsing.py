"""Request bodies read and checked the way vLLM's FastAPI models and validators do.

The order of the checks decides which 400 a client sees for a body with several faults, so
each route calls these in the order vLLM's request model validates its fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from aiohttp import web

from .chatml import ascii_text
from .errors import VLLMError, missing_fields_error, validation_error
from .wire import JSON


async def read_body(request: web.Request, required: Sequence[str] = ()) -> tuple[bytes, JSON]:
    """The raw body and its JSON object, or a VLLMError as FastAPI would reject it.

    `required` names the fields the route's model has no default for; missing ones are a 400.
    """
    media_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        raise VLLMError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
            400,
        )
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        pos = getattr(exc, "pos", 0)
        msg = getattr(exc, "msg", str(exc))
        detail = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": msg},
        }
        raise VLLMError(
            f"1 validation error:\n  {detail}", "Bad Request", 400, f"body.{pos}"
        ) from exc
    if not isinstance(body, dict):
        raise VLLMError(
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
            "'msg': 'Input should be a valid dictionary or object to extract fields from',"
            f" 'input': {ascii_text(body, 200)!r}}}",
            "Bad Request",
            400,
            "body",
        )
    missing = [name for name in required if name not in body]
    if missing:
        raise missing_fields_error(body, missing)
    return raw, body


def check_stream_options(body: JSON) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )


def check_int_field(body: JSON, name: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise validation_error(f"`{name}` must be an integer.", name, value)


def check_prompt_logprobs(body: JSON) -> None:
    check_int_field(body, "prompt_logprobs")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise validation_error(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise validation_error(
                "`prompt_logprobs` must be a positive value or -1.",
                "prompt_logprobs",
                prompt_logprobs,
            )


def usage_flags(body: JSON) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from `stream_options`."""
    options = body.get("stream_options") or {}
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))
