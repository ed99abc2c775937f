"""A vLLM logits processor that makes the tiny random-weight model call a tool.

A random model never writes tool-call markup, so verl's tool agent loop would never run a
tool. When a request's prompt offers the `word_count` tool (verl's chat template writes the
tool schema into the system prompt) and holds no tool result yet, this processor forces the
hermes markup `<tool_call>{...}</tool_call>` followed by `<|im_end|>`, token by token; every
other request (no such tool in the prompt, or a later turn) is left untouched, so the suite's
other tests see the model as it is. Loaded into the real vLLM CPU server with
`--logits-processors verl_harness.scripted_tool_call:ScriptedToolCall`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

TOOL_NAME = "word_count"
SCRIPT = '<tool_call>\n{"name": "word_count", "arguments": {"text": "one two three"}}\n</tool_call>'
TOOL_RESPONSE = "<tool_response>"


class ScriptedToolCall(AdapterLogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.script = [*self.tokenizer.encode(SCRIPT, add_special_tokens=False), end]
        self.trigger = f'"{TOOL_NAME}"'

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        decided: list[bool] = []

        def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> Any:
            if not decided:
                text = self.tokenizer.decode(prompt_ids)
                decided.append(self.trigger in text and TOOL_RESPONSE not in text)
            if not decided[0] or len(output_ids) >= len(self.script):
                return logits
            forced = self.script[len(output_ids)]
            keep = logits[forced].clone()
            logits.fill_(float("-inf"))
            logits[forced] = keep
            return logits

        return force
