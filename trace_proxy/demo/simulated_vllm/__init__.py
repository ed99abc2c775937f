"""A simulated vLLM OpenAI-compatible server: real tokens, no model.

`trace-proxy demo`, the tests and the latency benchmarks need an upstream that speaks vLLM's
wire format byte for byte but runs anywhere in milliseconds. This one follows vLLM 0.33.0
(`vllm/entrypoints/openai/{completion,chat_completion}`, `scale_out/token_in_token_out`,
`rl/online/api_router.py`, `serve/*`) as described in the project's reference
`inference-apis.md`: field order and null handling of every response model, `exclude_unset`
streaming chunks, the usage-only final chunk, mid-stream error events, `ErrorResponse` 400s,
the RL control routes and weight-version spans.

The "model" is deterministic: the output is chosen from a hash of the prompt token ids, its
token ids are the real Qwen tokenizer's encoding of that text (+ `<|im_end|>` at a stop), chat
prompts are rendered with the tokenizer's chat template so `prompt_token_ids` are real, and with
`tools` it looks up what the question asks (its arithmetic, the cities it names; now and then
wrongly) in Hermes `<tool_call>` blocks that are parsed the way vLLM's `hermes` tool parser
does. ChatML prompts sent as raw text or token ids get the same answers as the chat route.

The pieces that are not vLLM-specific (`TextModel`, `Engine`, `AbortLog`, `SSEStream`,
`SimulatedServer`, `start_app`) are shared with the fake SGLang server in the tests.

The package splits by route family, as vLLM's `entrypoints/openai/` does: `model` (the
deterministic model) and `policy` (which tool a question needs, with what arguments), `chatml`
and `hermes` (prompts read back, tool calls parsed), `engine` (pacing, pauses, aborts, weight
versions), `sse` and `server` (what both fakes share as servers), then the vLLM side: `errors`,
`parsing`, `logprobs`, `base` (what every route family shares), `completions`, `chat`,
`generate`, `control`, `utility` and `app` (the server).
"""

from .app import SimulatedVLLM
from .base import VLLM_VERSION
from .chatml import ascii_text, message_text, parse_chatml, tool_rounds
from .engine import PAUSED_MESSAGE, Engine, Flight, Paused
from .errors import (
    VLLMError,
    generation_error,
    missing_fields_error,
    paused_error,
    validation_error,
)
from .hermes import TOOL_CALL_END, TOOL_CALL_START, HermesStream, hermes_extract
from .model import Sample, SampleParams, TextModel
from .server import AbortLog, RecordedRequest, SimulatedServer, start_app
from .sse import DONE, EVENT_STREAM, KEEPALIVE, SSEStream
from .wire import (
    DEFAULT_MAX_MODEL_LEN,
    FIXED_CREATED,
    JSON,
    dumps,
    hex_digest,
    json_response,
    random_uuid,
)

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DONE",
    "EVENT_STREAM",
    "FIXED_CREATED",
    "JSON",
    "KEEPALIVE",
    "PAUSED_MESSAGE",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "VLLM_VERSION",
    "AbortLog",
    "Engine",
    "Flight",
    "HermesStream",
    "Paused",
    "RecordedRequest",
    "SSEStream",
    "Sample",
    "SampleParams",
    "SimulatedServer",
    "SimulatedVLLM",
    "TextModel",
    "VLLMError",
    "ascii_text",
    "dumps",
    "generation_error",
    "hermes_extract",
    "hex_digest",
    "json_response",
    "message_text",
    "missing_fields_error",
    "parse_chatml",
    "paused_error",
    "random_uuid",
    "start_app",
    "tool_rounds",
    "validation_error",
]
