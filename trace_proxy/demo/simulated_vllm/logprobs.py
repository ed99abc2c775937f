"""Logprobs in vLLM's three shapes: completions', chat's and the token-in generate route's.

The model's logprobs are made up but stable; what must match vLLM is the shape each route
returns them in (text offsets, byte lists, integer ids) and which candidates each one lists.
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import Sample, TextModel
from .wire import JSON


def prompt_logprobs(text: TextModel, prompt_ids: Sequence[int], count: int) -> list[JSON | None]:
    """`prompt_logprobs`: None for the first token, then `{id: Logprob}` per position."""
    out: list[JSON | None] = [None]
    for pos, token in enumerate(prompt_ids[1:], start=1):
        logprob = -round((hash((pos, token)) % 9000) / 1000, 4)
        cands = text.candidates(token, logprob, max(count, 1))
        out.append(
            {
                str(tid): {
                    "logprob": lp,
                    "rank": rank,
                    "decoded_token": text.token_text(tid),
                }
                for rank, (tid, lp) in enumerate(cands, start=1)
            }
        )
    return out


def token_str(text: TextModel, token_id: int, as_ids: bool) -> str:
    """A token as text, or as `token_id:N` with `return_tokens_as_token_ids`."""
    return f"token_id:{token_id}" if as_ids else text.token_text(token_id)


def completion_logprobs(
    text: TextModel, sample: Sample, start: int, end: int, count: int, as_ids: bool, offset: int
) -> tuple[JSON, int]:
    """`CompletionLogProbs` for tokens [start, end) and the next text offset."""
    offsets, token_logprobs, tokens, tops = [], [], [], []
    for pos in range(start, end):
        token, logprob = sample.token_ids[pos], sample.logprobs[pos]
        piece = token_str(text, token, as_ids)
        offsets.append(offset)
        offset += len(piece)
        token_logprobs.append(logprob)
        tokens.append(piece)
        top: JSON = {}
        for tid, lp in text.candidates(token, logprob, count)[: count + 1]:
            top.setdefault(token_str(text, tid, as_ids), lp)
        tops.append(top)
    body = {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }
    return body, offset


def chat_logprobs(
    text: TextModel, sample: Sample, start: int, end: int, top: int, as_ids: bool
) -> JSON:
    """`ChatCompletionLogProbs` for tokens [start, end)."""
    content = []
    for pos in range(start, end):
        token, logprob = sample.token_ids[pos], sample.logprobs[pos]
        piece = token_str(text, token, as_ids)
        alternatives = text.candidates(token, logprob, top)[: max(top, 0)]
        content.append(
            {
                "token": piece,
                "logprob": logprob,
                "bytes": list(piece.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (alt := token_str(text, tid, as_ids)),
                        "logprob": lp,
                        "bytes": list(alt.encode("utf-8", errors="replace")),
                    }
                    for tid, lp in alternatives
                ],
            }
        )
    return {"content": content}


def generate_logprobs(text: TextModel, sample: Sample, start: int, end: int, count: int) -> JSON:
    """`GenerateLogProbs` (integer ids; every candidate the engine returned)."""
    content = []
    for pos in range(start, end):
        token, logprob = sample.token_ids[pos], sample.logprobs[pos]
        cands = text.candidates(token, logprob, count)
        content.append(
            {
                "token_id": token,
                "logprob": logprob,
                "rank": 1,
                "top_logprobs": [
                    {"token_id": tid, "logprob": lp, "rank": rank}
                    for rank, (tid, lp) in enumerate(cands, start=1)
                ],
            }
        )
    return {"content": content}
