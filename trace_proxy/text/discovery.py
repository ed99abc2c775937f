"""Find the served model's tokenizer by asking the upstream, when `--tokenizer` is not given.

vLLM's `/v1/models` lists each served name with `root`, the model path it was started with;
SGLang's `/model_info` gives `model_path`. When that path exists on this machine (a sidecar
usually shares the node's model directory), its tokenizer is loaded. An upstream that is not
up yet is asked again; a path that is not here is reported once, clearly, and not retried.
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from trace_proxy.text.drift import codec_for
from trace_proxy.text.token2text import (
    TokenizerError,
    Tokenizers,
    decoder_for,
    load_tokenizer,
)

log = logging.getLogger(__name__)


async def served_models(session: aiohttp.ClientSession, upstream: str) -> dict[str, str]:
    """{served name: model path} as the upstream reports them; {} if it answers neither route."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(upstream + "/v1/models", timeout=timeout) as response:
        if response.status == 200:
            body = await response.json(content_type=None)
            models = {
                str(m["id"]): str(m.get("root") or m["id"])
                for m in (body or {}).get("data") or []
                if isinstance(m, dict) and m.get("id")
            }
            if models:
                return models
    async with session.get(upstream + "/model_info", timeout=timeout) as response:
        if response.status == 200:
            info = await response.json(content_type=None)
            path = (info or {}).get("model_path")
            if isinstance(path, str):
                return {path: path}
    return {}


async def discover_tokenizers(
    session: aiohttp.ClientSession,
    upstreams: list[str],
    tokenizers: Tokenizers,
    skip_special_tokens: bool,
    retry_every: float = 5.0,
) -> None:
    """Runs until every upstream has answered once; loads what is found on this machine."""
    pending = list(upstreams)
    while pending:
        for upstream in list(pending):
            try:
                models = await served_models(session, upstream)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue  # not up yet: ask again later
            pending.remove(upstream)
            for name, path in models.items():
                if not os.path.isdir(path):
                    log.error(
                        "token2text: %s serves %r from %s, which is not on this machine; "
                        "records will have no decoded text until --tokenizer names a copy",
                        upstream, name, path,
                    )  # fmt: skip
                    continue
                try:
                    tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except TokenizerError as exc:
                    log.error("token2text: %s", exc)
                    continue
                tokenizers.add(
                    name, decoder_for(tokenizer, skip_special_tokens), codec_for(tokenizer)
                )
                log.info("token2text: decoding %r with the tokenizer of %s", name, path)
        if pending:
            await asyncio.sleep(retry_every)
