"""Retokenization drift on a REAL vLLM: a text client on /v1/completions keeps each reply as
text; the tiny random-weight model's greedy ids often do not survive decoding and encoding
again. The proxy's marks must be exactly what the real tokenizer and vLLM's own prompt ids say."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from openai import AsyncOpenAI
from support.proxies import running_proxy, trajectories

from trace_proxy.text.drift import codec_for
from trace_proxy.text.token2text import load_tokenizer

if TYPE_CHECKING:
    from .conftest import RealServer

FIRST = "<|im_start|>user\nWrite a short poem about rivers.<|im_end|>\n<|im_start|>assistant\n"
MORE = "<|im_end|>\n<|im_start|>user\nAnother verse.<|im_end|>\n<|im_start|>assistant\n"
TURNS = 4


def continues(prompt: list[int], response: list[int], following: list[int], special: Any) -> bool:
    """The next prompt begins with prompt + response (the stop token may be left out)."""
    expected = [*prompt, *response]
    if following[: len(expected)] == expected:
        return True
    kept = expected[:-1]
    return bool(response) and response[-1] in special and following[: len(kept)] == kept


async def test_real_vllm_drift_marks_agree_with_the_tokenizer(
    real_vllm: RealServer, tmp_path: Path
) -> None:
    settings = {"token2text": True, "tokenizer": [str(real_vllm.model_dir)]}
    async with running_proxy([real_vllm.base_url], tmp_path, **settings) as (service, proxy):
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="none", timeout=180)
        prompt, replies = FIRST, []
        for turn in range(TURNS):
            headers = {"X-Rollout-Trajectory-Id": "real-text-client"}
            if turn == TURNS - 1:
                headers["X-Rollout-Done"] = "true"
            reply = await client.completions.create(
                model=real_vllm.model, prompt=prompt, max_tokens=24, temperature=0,
                extra_body={"return_token_ids": True}, extra_headers=headers,
            )  # fmt: skip
            replies.append(reply.choices[0].model_extra)
            prompt = prompt + reply.choices[0].text + MORE  # the reply kept as text
        await client.close()
        await service.flush()
    codec = codec_for(load_tokenizer(str(real_vllm.model_dir)))
    [trajectory] = trajectories(tmp_path)
    calls = trajectory["calls"]
    assert len(calls) == TURNS
    drifting = 0
    for position, call in enumerate(calls):
        generated = replies[position]["token_ids"]
        assert call["outputs"][0]["token_ids"] == generated
        marks = call["drift"] or {}
        again = codec.encode(codec.decode(generated))
        assert ("roundtrip" in marks) == (again != generated), position
        if position + 1 < TURNS:
            following = replies[position + 1]["prompt_token_ids"]
            ok = continues(replies[position]["prompt_token_ids"], generated, following,
                           codec.special)  # fmt: skip
            assert ("prefix" in marks) == (not ok), position
        drifting += bool(marks)
    assert trajectory["summary"]["drift_calls"] == drifting
    # The random model's text does not survive re-tokenization: the case this is about.
    assert drifting > 0, [r["token_ids"] for r in replies]
