"""token2text: decoded text next to the token ids, for the trajectories that are kept.

It runs as a processor of the export pipeline, in its own thread, once per closed trajectory:
never on the event loop, never for a trajectory that is not exported, with each tokenizer
loaded once. Special tokens are kept by default, as verl's rollout trace keeps them, so the
text shows the chat template's markers and tool-call tags exactly as the model saw them.

Tokenizers come from `--tokenizer` (a path, or a name in the local Hugging Face cache, loaded
with HF_HUB_OFFLINE=1 unless the environment says otherwise), or, when none is given, from the
upstream itself: vLLM's `/v1/models` (`root`) or SGLang's `/model_info` (`model_path`) name
the model directory, which is loaded when it exists on this machine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from trace_proxy.text.drift import Codec, codec_for, mark_drift
from trace_proxy.text.toolparsers import ToolCallParser
from trace_proxy.text.tools import text_tool_spans
from trace_proxy.trajectories.prompts import full_token_ids, pieces_text
from trace_proxy.trajectories.record import Record, Trajectory, ids_list

log = logging.getLogger(__name__)

Decode = Callable[[Sequence[int]], str]


class TokenizerError(RuntimeError):
    """A tokenizer that cannot be loaded; raised once, at start-up (the proxy ends on it)."""


def load_tokenizer(source: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub from a GPU node
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            "token2text needs transformers: pip install 'trace-proxy[text]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)  # code never runs
    except Exception as exc:  # transformers raises many kinds; all mean "not loadable"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerError(f"cannot load tokenizer {source!r}: {reason}") from None


def decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """The fastest exact decode: the Rust backend, unless the tokenizer post-processes spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):

        def decode_backend(ids: Sequence[int]) -> str:
            text: str = backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
            return text

        return decode_backend

    def decode_python(ids: Sequence[int]) -> str:
        text: str = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    return decode_python


class Tokenizers:
    """Which decoder serves which model: one per served model name, or one for all; and the
    same tokenizer as a `Codec` for the drift checks, where it was added with one."""

    def __init__(self) -> None:
        self._by_model: dict[str, tuple[Decode, Codec | None]] = {}
        self._default: tuple[Decode, Codec | None] | None = None
        self._lock = threading.Lock()  # discovery adds while the export thread reads

    def add(self, model: str | None, decode: Decode, codec: Codec | None = None) -> None:
        with self._lock:
            if model is None:
                self._default = (decode, codec)
            else:
                self._by_model[model] = (decode, codec)

    def _entry(self, model: str | None) -> tuple[Decode, Codec | None] | None:
        with self._lock:
            if model is not None and model in self._by_model:
                return self._by_model[model]
            if self._default is not None:
                return self._default
            if len(self._by_model) == 1:  # one served model under any name
                return next(iter(self._by_model.values()))
            return None

    def for_model(self, model: str | None) -> Decode | None:
        entry = self._entry(model)
        return None if entry is None else entry[0]

    def codec_for_model(self, model: str | None) -> Codec | None:
        entry = self._entry(model)
        return None if entry is None else entry[1]

    @property
    def empty(self) -> bool:
        with self._lock:
            return self._default is None and not self._by_model


def check_configured(sources: list[str]) -> None:
    """What can be told without loading anything (milliseconds, before the proxy listens):
    transformers is missing, or a `--tokenizer` path does not exist. Loading happens in the
    export process, whose start-up is not waited for; what it finds is reported then."""
    if importlib.util.find_spec("transformers") is None:
        raise TokenizerError(
            "decoding token ids (--token2text, --tokenizer) needs transformers: "
            "pip install 'trace-proxy[text]'"
        )
    for source in sources:
        _, eq, path = source.partition("=")
        if not eq or os.path.exists(source):
            path = source
        explicit = os.path.isabs(path) or path.startswith(("./", "../"))
        if explicit and not os.path.exists(path):  # not a Hugging Face name either
            raise TokenizerError(f"cannot load tokenizer {path!r}: no such directory")


def load_configured(sources: list[str], skip_special_tokens: bool) -> Tokenizers:
    """`--tokenizer` values (`PATH` or `MODEL=PATH`), loaded now so a bad one fails at start-up."""
    tokenizers = Tokenizers()
    for source in sources:
        model, eq, path = source.partition("=")
        if not eq or os.path.exists(source):
            model, path = "", source
        tokenizer = load_tokenizer(path)
        tokenizers.add(
            model or None, decoder_for(tokenizer, skip_special_tokens), codec_for(tokenizer)
        )
    return tokenizers


class Token2Text:
    """Pipeline processor: fills prompt_text, response_text, transcript and text tool spans,
    and marks retokenization drift (drift.py; `on_drift` is told each drifting call's kinds)."""

    name = "token2text"

    def __init__(
        self,
        tokenizers: Tokenizers,
        tool_parser: ToolCallParser,
        on_skip: Callable[[str], None] | None = None,
        on_drift: Callable[[str], None] | None = None,
        check_drift: bool = True,
    ) -> None:
        self.tokenizers = tokenizers
        self._parser = tool_parser
        self._on_skip = on_skip
        self._on_drift = on_drift
        self._check_drift = check_drift

    @property
    def inactive(self) -> bool:
        """Without a tokenizer it changes nothing (the runner may then skip decoding lines)."""
        return self.tokenizers.empty

    def passed_over(self, trajectories: int) -> None:
        """Trajectories exported without coming here while inactive: skipped all the same."""
        if self._on_skip is not None:
            for _ in range(trajectories):
                self._on_skip("no_tokenizer")

    def process(self, records: list[Record]) -> None:
        for record in records:
            if isinstance(record, Trajectory):
                self._decode(record)

    def _decode(self, trajectory: Trajectory) -> None:
        calls = trajectory.calls
        decoders = [self.tokenizers.for_model(call.model) for call in calls]
        if not any(decoders):
            if self._on_skip is not None:
                self._on_skip("no_tokenizer")
            return
        for call, decode in zip(calls, decoders, strict=True):
            if decode is None:
                continue
            prompt_ids = ids_list(call.prompt.token_ids)
            if prompt_ids is not None:
                call.prompt_text = decode(prompt_ids)
            for output in call.outputs:
                if output.token_ids:
                    output.response_text = decode(output.token_ids)
        full = full_token_ids(calls)
        if self._check_drift:
            codecs = [self.tokenizers.codec_for_model(call.model) for call in calls]
            if any(codecs):
                mark_drift(trajectory, full, codecs, self._on_drift)
        for position in range(len(calls) - 1, -1, -1):
            decode, ids = decoders[position], full[position]
            if decode is not None and ids is not None:
                first = calls[position].outputs[0].token_ids if calls[position].outputs else None
                whole = decode([*ids, *(first or [])])
                # Stored only when the calls' pieces do not already spell it out.
                if pieces_text(calls[: position + 1]) != whole:
                    trajectory.transcript = whole
                break
        spans = text_tool_spans(calls, full, decoders, self._parser)
        if spans:
            merged = sorted([*trajectory.tools, *spans], key=lambda t: (t.start, t.index))
            for index, span in enumerate(merged):
                span.index = index
            trajectory.tools = merged
            trajectory.summary["tool_calls"] = len(merged)
