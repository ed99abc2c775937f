"""vLLM's `ErrorResponse` and the messages its validators and exception handlers write.

Clients and the proxy see these bodies verbatim, so each one follows the text vLLM 0.33 sends:
`VLLMValidationError`, FastAPI's `RequestValidationError`, the paused engine, a failed step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from .engine import PAUSED_MESSAGE
from .wire import JSON, json_response


class VLLMError(Exception):
    """An `ErrorResponse` to send: `{"error":{"message","type","param","code"}}`."""

    def __init__(self, message: str, err_type: str, code: int, param: str | None = None):
        super().__init__(message)
        self.message, self.err_type, self.code, self.param = message, err_type, code, param

    def body(self) -> JSON:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), self.code)


def validation_error(message: str, parameter: str, value: Any = None) -> VLLMError:
    """vLLM's `VLLMValidationError` as its exception handler renders it (400)."""
    extras = [f"parameter={parameter}"] + ([f"value={value}"] if value is not None else [])
    return VLLMError(f"{message} ({', '.join(extras)})", "BadRequestError", 400, parameter)


def missing_fields_error(body: JSON, fields: Sequence[str]) -> VLLMError:
    """FastAPI's RequestValidationError for missing body fields, as vLLM renders it."""
    entries = [
        str(
            {
                "type": "missing",
                "loc": f"body.{name}",
                "msg": "Field required",
                "input": f"<dict of {len(body)} items>",
            }
        )
        for name in fields
    ]
    label = "error" if len(entries) == 1 else "errors"
    message = f"{len(entries)} validation {label}:\n" + "".join(f"  {e}\n" for e in entries)
    return VLLMError(message.rstrip(), "Bad Request", 400, f"body.{fields[0]}")


def not_an_object_error(name: str, value: Any, model: str) -> VLLMError:
    """FastAPI's RequestValidationError for a body field typed as a msgspec model (generate's
    `sampling_params: SamplingParams`) given something other than an object: pydantic's two
    branches, each rendered by vLLM's `_format_error` (the input summarised, the loc cleaned)."""
    shown = _summarised(value)
    entries = [
        {"type": "is_instance_of", "loc": f"body.{name}",
         "msg": f"Input should be an instance of {model}", "input": shown,
         "ctx": {"class": model}},
        {"type": "dict_type", "loc": f"body.{name}", "msg": "Input should be a valid dictionary",
         "input": shown},
    ]  # fmt: skip
    message = "2 validation errors:\n" + "\n".join(f"  {e}" for e in entries)
    return VLLMError(message, "Bad Request", 400, f"body.{name}")


def _summarised(value: Any) -> str:
    """vLLM's `_summarize_error_input`: containers described, other values as `str` shows them
    (a JSON null is Python's None), cut at 200 characters."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def paused_error() -> VLLMError:
    return VLLMError(PAUSED_MESSAGE, "ServiceUnavailableError", 503)


def generation_error() -> VLLMError:
    return VLLMError("Internal server error", "InternalServerError", 500)


def spaced_error(error: VLLMError) -> bytes:
    """`json.dumps(ErrorResponse.model_dump())`: how completions/generate stream errors."""
    return json.dumps(error.body()).encode()
