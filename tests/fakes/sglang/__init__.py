"""A fake SGLang server for the tests.

Follows sglang 0.5.23 `srt/entrypoints/http_server.py` (with the tokenizer manager and the
OpenAI serving classes behind it) as described in the reference `inference-apis.md`, checked
against the wheel's source: `/generate` with text or ids, single or batched, `n` > 1 as a JSON
list, CUMULATIVE streaming by default (`incremental_streaming_output=True` for deltas), logprob
tuples `[logprob, token_id, text|null]`, meta_info fields in the manager's order, the schema
gate's 400 `{"error": "..."}` and the control routes RL trainers call. The text generation,
tokenization, pacing, abort tracking and server start are the simulated vLLM's
(`trace_proxy.demo.simulated_vllm`), so both fakes answer a prompt the same way.

The package splits by route family, as SGLang's sources do: `contract` (the `/generate` schema
gate, `srt/entrypoints/api_contract.py`), `base` (what every family shares, and what the OpenAI
routes share as `srt/entrypoints/openai/serving_base.py` holds it; the limits a prompt is
admitted under, from the tokenizer manager's length checks to the crash an empty prompt
causes in the scheduler), `generate` (`/generate` and
its streaming, with `srt/managers/io_struct.py` and `tokenizer_manager.py`), `completions` and
`chat` (`srt/entrypoints/openai/serving_completions.py` and `serving_chat.py`), `control` (the
cache flush, aborts, pause and continue, weight updates and versions), `utility` (health, model
and server info, models), `gateway` (sgl-model-gateway's worker registration) and `app`
(`FakeSGLang`: the families put together, the knobs, the route table).
"""

from .app import FakeSGLang
from .base import SGLANG_VERSION
from .contract import SAMPLING_FIELDS, ContractError, contract_error
from .control import FLUSH_CACHE_TEXT

__all__ = [
    "FLUSH_CACHE_TEXT",
    "SAMPLING_FIELDS",
    "SGLANG_VERSION",
    "ContractError",
    "FakeSGLang",
    "contract_error",
]
