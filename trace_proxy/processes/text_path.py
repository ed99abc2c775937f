"""The text path, wired in one place: token2text on an export runner, the tokenizers it decodes
with, and the served models' tokenizers found by asking the upstreams when none is configured.

Whichever process exports builds it here: the export process, the `Recorder` when it exports
inline (`--export-mode inline`, exporter objects handed to the proxy) and `trace-proxy recover`,
so the three decode alike. The capture process loads the same `--tokenizer`s for telling
rollouts apart (`load_tokenizers`).
"""

from __future__ import annotations

import asyncio
from typing import TypeGuard

import aiohttp

from trace_proxy.config import Settings
from trace_proxy.exporters.runner import ExportRunner
from trace_proxy.metrics import ExportMetrics
from trace_proxy.text.discovery import discover_tokenizers
from trace_proxy.text.token2text import Token2Text, Tokenizers, load_configured
from trace_proxy.text.toolparsers import get_parser


async def load_tokenizers(settings: Settings) -> Tokenizers:
    """The `--tokenizer`s, loaded in a worker thread (TokenizerError if one cannot be)."""
    return await asyncio.to_thread(
        load_configured, settings.tokenizer, settings.skip_special_tokens
    )


async def add_token2text(
    settings: Settings, runner: ExportRunner, metrics: ExportMetrics
) -> Token2Text | None:
    """token2text as `runner`'s processor when `--token2text` asks for it, its configured
    tokenizers loaded first (TokenizerError if one cannot be); None when not asked."""
    if not settings.token2text:
        return None
    token2text = Token2Text(
        await load_tokenizers(settings),
        get_parser(settings.tool_parser),
        on_skip=lambda reason: metrics.token2text_skipped.labels(reason).inc(),
        on_drift=lambda kind: metrics.drift_calls.labels(kind).inc(),
        check_drift=settings.drift_check,
    )
    runner.add_processor(token2text)
    return token2text


def needs_discovery(token2text: Token2Text | None) -> TypeGuard[Token2Text]:
    """Whether token2text decodes with the served models' tokenizers, still to be found."""
    return token2text is not None and token2text.tokenizers.empty


async def discover_served(settings: Settings, tokenizers: Tokenizers) -> None:
    """The served models' tokenizers added to `tokenizers`, each upstream asked until it has
    answered once; a session of its own, off the forwarding path."""
    async with aiohttp.ClientSession() as session:
        await discover_tokenizers(
            session, settings.upstream, tokenizers, settings.skip_special_tokens
        )
