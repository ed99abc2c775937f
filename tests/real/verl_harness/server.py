"""A stand-in for verl's `vLLMHttpServer` Ray actor, in front of the real vLLM CPU server.

verl's own server actor embeds vLLM's engine and needs a GPU; this actor keeps its interface
(`generate(prompt_ids, sampling_params, request_id, ..., priority)` returning verl's
`TokenOutput`, `global_steps`, `set_global_steps`, `abort_all_requests`, `resume_generation`)
and its semantics as verl 0.9.1 writes them in `vllm_async_server.py`: in `generate`, the
default `max_tokens` (response length, capped by prompt + response length minus the prompt,
and by the context), `logprobs` as 0 or None, `repetition_penalty` and `ignore_eos` from the
rollout config, finish reasons stop/length as "completed" and abort as "aborted",
`extra_fields={"global_steps", "num_cached_tokens"}` with `global_steps` read when the
generate ends; the submission gate (`_submission_paused`, `_rejecting`, `_resume_event`):
`abort_all_requests` closes it and pauses the engine aborting every request in flight,
`resume_generation` resumes the engine and opens it, and a generate waits at a closed gate
(`_park_until_admitted`) or, when it rejects late arrivals, answers "aborted" at once. The
engine behind it is the real vLLM, asked token-in/token-out on `/inference/v1/generate`
directly (never through trace-proxy), and paused and resumed with vLLM's own `/pause?mode=abort`
and `/resume` (what verl's server calls in-process): this is verl's path without the plugin.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import ray
from verl.workers.rollout.replica import TokenOutput


class VerlServerStandIn:
    """verl's server actor's `generate`, over a vLLM's HTTP API at `base_url`."""

    def __init__(self, base_url: str, rollout: dict[str, Any]) -> None:
        self.base_url = base_url
        self.rollout = rollout
        self.global_steps: int | None = None
        self.calls = 0
        self._submission_paused = False
        self._rejecting = False
        self._resume_event = asyncio.Event()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Close the gate, then pause the engine, aborting every request in flight."""
        self._submission_paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        await self._post("/pause?mode=abort")

    async def resume_generation(self) -> None:
        """Resume the engine, then open the gate."""
        await self._post("/resume")
        self._rejecting = False
        self._submission_paused = False
        self._resume_event.set()

    async def resume_generation_held(self) -> None:
        """`resume_generation` with the engine left frozen (vLLM's `/pause?mode=keep`) before
        the gate opens: the calls let in wait inside vLLM, where nothing generates until the
        harness posts `/resume`. verl has no such call; it starts a batch together."""
        await self._post("/resume")
        await self._post("/pause?mode=keep")
        self._rejecting = False
        self._submission_paused = False
        self._resume_event.set()

    async def _post(self, path: str) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.base_url + path) as response,
        ):
            if response.status != 200:
                raise RuntimeError(f"vLLM answered {path} {response.status}")

    async def _park_until_admitted(self) -> TokenOutput | None:
        while self._submission_paused:
            if self._rejecting:
                return TokenOutput(token_ids=[], log_probs=None, routed_experts=None,
                                   stop_reason="aborted",
                                   extra_fields={"global_steps": self.global_steps})  # fmt: skip
            await self._resume_event.wait()
        return None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
    ) -> TokenOutput:
        self.calls += 1
        config = self.rollout
        room = config["max_model_len"] - len(prompt_ids)
        if "max_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_tokens")
        elif "max_new_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_new_tokens")
        else:
            max_tokens = min(
                config["response_length"],
                config["prompt_length"] + config["response_length"] - len(prompt_ids),
            )
        max_tokens = max(1, min(max_tokens, room))
        sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
        sampling_params.setdefault("repetition_penalty", config.get("repetition_penalty", 1.0))
        sampling_params.setdefault("ignore_eos", config.get("ignore_eos", False))
        body = {
            "token_ids": list(prompt_ids),
            "sampling_params": {**sampling_params, "max_tokens": max_tokens},
            "request_id": request_id,
        }
        if priority:
            body["priority"] = priority
        rejected = await self._park_until_admitted()
        if rejected is not None:
            return rejected
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.base_url}/inference/v1/generate", json=body) as response,
        ):
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"vLLM answered {response.status}: {answer}")
        extra_fields: dict[str, Any] = {"global_steps": self.global_steps}
        choice = answer["choices"][0]
        extra_fields["num_cached_tokens"] = None
        token_ids = list(choice["token_ids"])
        log_probs = None
        if sampling_params["logprobs"] is not None:
            content = (choice.get("logprobs") or {}).get("content") or []  # none when aborted
            log_probs = [entry["logprob"] for entry in content]
        finish = choice["finish_reason"]
        stop_reason = {"abort": "aborted", "stop": "completed", "length": "completed"}.get(
            finish, finish
        )
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            routed_experts=None,
            stop_reason=stop_reason,
            extra_fields=extra_fields,
        )


CpuVllmServer = ray.remote(VerlServerStandIn)
