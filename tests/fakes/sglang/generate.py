"""SGLang's native `/generate`: text or token ids in, single or batched, whole or streamed.

Follows sglang 0.5.23 `srt/entrypoints/http_server.py` (`generate_request`), with
`GenerateReqInput.normalize_batch_and_arguments` (`srt/managers/io_struct.py`) for batches,
rids and `n`, and `srt/managers/tokenizer_manager.py` for the n-expansion and the `meta_info`
fields in the manager's order: `n` > 1 answers a JSON list, streams are CUMULATIVE unless
`incremental_streaming_output` (`--incremental-streaming-output`) asks for deltas, and logprobs
are `[logprob, token_id, text|null]` tuples.

What it refuses, and how, follows the same code: the schema gate's `{"error": "<text>"}`;
a `ValueError` from normalisation or the manager's length checks as 400 `{"error":
{"message"}}` (`_create_error_response`), or once streaming began as an error event with code
400; a prompt within the scheduler's reserve aborted with status 400 (the whole answer a 400,
or that sequence's only chunk when streamed). `"text": []` is a batch of none: the manager
sends nothing and answers `[]` (a stream of only `[DONE]`). An empty prompt (`"input_ids":
[[]]`, `"text": ""`) passes every check and kills the server (`SGLangBase._crash`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from trace_proxy.demo.simulated_vllm import (
    FIXED_CREATED,
    JSON,
    Flight,
    Sample,
    SampleParams,
    SSEStream,
    dumps,
    json_response,
)

from .base import SGLangBase, new_token_budget
from .contract import contract_error

DEFAULT_MAX_NEW_TOKENS = 128  # `SamplingParams.max_new_tokens` (`srt/sampling/sampling_params.py`)


@dataclass
class _Seq:
    """One output sequence of a `/generate` request."""

    position: int  # index in the response list / the streamed `index`
    rid: str
    prompt_ids: tuple[int, ...]
    sample: Sample
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    max_new_tokens: int
    refusal: str | None = None  # the scheduler's abort message, when it refuses the prompt


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) and value[i] is not None else default
    return default if value is None else value


class GenerateRoutes(SGLangBase):
    """`/generate` (POST and PUT), its batches, `n` > 1 and both ways of streaming."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:  # FastAPI's decode of the `GenerateReqInput` body
            return self._validation_error(
                [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                  "input": {}, "ctx": {"error": exc.msg}}]
            )  # fmt: skip
        error = contract_error(body)
        if error is not None:
            return json_response({"error": error}, 400)
        stream = bool(body.get("stream"))
        try:
            seqs, single = self._expand(body, raw)
        except ValueError as exc:
            if stream:
                return await self._stream_error(request, str(exc))
            return json_response({"error": {"message": str(exc)}}, 400)
        if any(not seq.prompt_ids for seq in seqs):
            return await self._crash(request)
        if not seqs:  # `_handle_batch_request` with a batch of none: nothing to wait for
            if stream:
                sse = SSEStream(request, keepalive=False, error_after=None, error_event=b"")
                await sse.open()
                return await sse.finish()
            return json_response([])
        refusal = next((seq.refusal for seq in seqs if seq.refusal), None)
        if refusal is not None and not stream:  # `_handle_abort_finish_reason` raises it
            return json_response({"error": {"message": refusal}}, 400)
        flight = self.engine.admit(seq.rid for seq in seqs)
        started = time.perf_counter()
        rids = [seq.rid for seq in seqs]
        if stream:
            return await self._run(
                flight, rids, lambda: self._generate_stream(request, body, seqs, single, flight)
            )
        return await self._run(
            flight, rids, lambda: self._generate_full(body, seqs, single, flight, started)
        )

    def _expand(self, body: JSON, raw: bytes) -> tuple[list[_Seq], bool]:
        """`GenerateReqInput.normalize_batch_and_arguments` + the manager's n-expansion."""
        text: Any = body.get("text")
        input_ids: Any = body.get("input_ids")
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            single = isinstance(text, str)
            prompts = [self.text.encode(t, True) for t in ([text] if single else text)]
        else:
            if len(input_ids) == 0:
                raise ValueError("input_ids cannot be empty.")
            single = isinstance(input_ids[0], int)
            prompts = [tuple(input_ids)] if single else [tuple(row) for row in input_ids]
        params_in = body.get("sampling_params") or {}
        all_params = params_in if isinstance(params_in, list) else [params_in] * len(prompts)
        n = int((all_params[0] if all_params else {}).get("n") or 1)
        if any(int(p.get("n") or 1) != n for p in all_params):
            raise ValueError(
                "The parallel_sample_num should be the same for all samples in sample params."
            )
        rid = body.get("rid")
        if single and n == 1:
            rids = [rid if isinstance(rid, str) else self.new_id(raw, "rid", size=16)]
        elif n > 1:  # the manager gives every sample a fresh uuid
            rids = [self.new_id(raw, "rid", str(i), size=16) for i in range(len(prompts) * n)]
        elif rid is None:
            rids = [self.new_id(raw, "rid", str(i), size=16) for i in range(len(prompts))]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(len(prompts))]
        else:
            if len(rid) != len(prompts):
                raise ValueError(
                    "The specified rids length mismatch with the batch_size for batch processing."
                )
            rids = list(rid)
        if len(set(rids)) != len(rids):
            duplicates = sorted({r for r in rids if rids.count(r) > 1})
            raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
        seqs: list[_Seq] = []
        for p, prompt_ids in enumerate(prompts):
            sp = all_params[p] if p < len(all_params) else {}
            self._check_length(len(prompt_ids), sp.get("max_new_tokens"))
        for p, prompt_ids in enumerate(prompts):
            sp = all_params[p] if p < len(all_params) else {}
            params = self._params(sp, len(prompt_ids))
            refusal = self._scheduler_refusal(len(prompt_ids))
            for j in range(n):
                position = len(seqs)
                seed = self.text.seed_for(prompt_ids, j, params)
                sample = self.text.sample(self.text.plan(prompt_ids, seed), params, seed)
                seqs.append(
                    _Seq(
                        position,
                        rids[position],
                        prompt_ids,
                        sample,
                        bool(_per_item(body.get("return_logprob"), p, False)),
                        int(_per_item(body.get("top_logprobs_num"), p, 0)),
                        int(_per_item(body.get("logprob_start_len"), p, -1)),
                        params.max_tokens,
                        refusal,
                    )
                )
        return seqs, single and n == 1

    def _params(self, sp: JSON, prompt_len: int) -> SampleParams:
        stop = sp.get("stop") or []
        max_new = sp.get("max_new_tokens")
        asked = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
        return SampleParams(
            max_tokens=new_token_budget(prompt_len, asked, self.text.max_model_len),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos")),
            skip_special_tokens=sp.get("skip_special_tokens") is not False,
            seed=sp.get("sampling_seed"),
            greedy=sp.get("temperature") == 0 or sp.get("top_k") == 1,
        )

    def _finish_reason(self, seq: _Seq, count: int, aborted: bool) -> JSON:
        s = seq.sample
        if seq.refusal is not None:  # `Req.set_finish_with_abort`
            return {
                "type": "abort",
                "message": seq.refusal,
                "status_code": 400,
                "err_type": "BadRequestError",
            }
        if aborted:
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        if s.finish_reason == "length":
            return {"type": "length", "length": count}
        matched = s.stop_reason if s.stop_reason is not None else s.token_ids[count - 1]
        return {"type": "stop", "matched": matched}

    def _logprob_fields(self, seq: _Seq, body: JSON, start: int, end: int) -> JSON:
        with_text = bool(body.get("return_text_in_logprobs"))

        def entry(token: int, logprob: float | None) -> list[Any]:
            return [logprob, token, self.text.token_text(token) if with_text else None]

        s = seq.sample
        fields: JSON = {}
        inputs: list[list[Any]] = []
        input_tops: list[list[list[Any]] | None] = []
        if seq.logprob_start_len >= 0:
            for pos in range(seq.logprob_start_len, len(seq.prompt_ids)):
                token = seq.prompt_ids[pos]
                logprob = None if pos == 0 else -round((hash((pos, token)) % 9000) / 1000, 4)
                inputs.append(entry(token, logprob))
                input_tops.append(
                    None
                    if logprob is None
                    else [
                        entry(t, lp)
                        for t, lp in self.text.candidates(token, logprob, seq.top_logprobs_num)
                    ]
                )
        fields["input_token_logprobs"] = inputs
        fields["output_token_logprobs"] = [
            entry(s.token_ids[i], s.logprobs[i]) for i in range(start, end)
        ]
        fields["output_token_logprobs_length"] = end
        if seq.top_logprobs_num > 0:
            fields["input_top_logprobs"] = input_tops
            fields["output_top_logprobs"] = [
                [
                    entry(t, lp)
                    for t, lp in self.text.candidates(
                        s.token_ids[i], s.logprobs[i], seq.top_logprobs_num
                    )
                ]
                for i in range(start, end)
            ]
        return fields

    def _meta_info(
        self,
        seq: _Seq,
        body: JSON,
        *,
        start: int,
        end: int,
        finished: bool,
        aborted: bool,
        flight: Flight,
        elapsed: float,
        first: bool,
    ) -> JSON:
        """meta_info in the tokenizer manager's key order."""
        meta: JSON = {
            "id": seq.rid,
            "finish_reason": self._finish_reason(seq, end, aborted) if finished else None,
            # a refused request's prompt is replaced by one token (`set_finish_with_abort`)
            "prompt_tokens": 1 if seq.refusal else len(seq.prompt_ids),
            "weight_version": self.engine.weight_version,
            "num_retractions": 0,
        }
        if seq.return_logprob and not seq.refusal:
            meta.update(self._logprob_fields(seq, body, start, end))
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = end
        meta["cached_tokens"] = 0
        if finished:
            spans = flight.weight_versions(end) if flight.version_starts else []
            meta["weight_versions"] = spans
            if spans:
                meta["weight_version"] = spans[-1]["version"]
            meta["e2e_latency"] = round(0.001 * (end + 1), 6) if self.deterministic else elapsed
        if first:
            meta["response_sent_to_client_ts"] = (
                FIXED_CREATED + 0.5 if self.deterministic else time.time()
            )
        return meta

    def _out(self, seq: _Seq, body: JSON, text: str, ids: list[int], meta: JSON) -> JSON:
        out: JSON = {"text": text, "output_ids": ids, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = list(seq.prompt_ids)
        return out

    async def _generate_full(
        self, body: JSON, seqs: list[_Seq], single: bool, flight: Flight, started: float
    ) -> web.StreamResponse:
        longest = max(len(seq.sample.token_ids) for seq in seqs)
        steps = await self.engine.run(flight, longest)
        if self.error_after_chunks is not None:
            return json_response({"error": {"message": "Internal server error"}}, 500)
        elapsed = time.perf_counter() - started
        outs = []
        for seq in seqs:
            count = min(steps, len(seq.sample.token_ids))
            aborted = count < len(seq.sample.token_ids)
            sample = seq.sample.prefix(count) if aborted else seq.sample
            meta = self._meta_info(
                seq,
                body,
                start=0,
                end=count,
                finished=True,
                aborted=aborted,
                flight=flight,
                elapsed=elapsed,
                first=True,
            )
            outs.append(self._out(seq, body, sample.text, list(sample.token_ids), meta))
        return json_response(outs[0] if single else outs)

    async def _generate_stream(
        self, request: web.Request, body: JSON, seqs: list[_Seq], single: bool, flight: Flight
    ) -> web.StreamResponse:
        started = time.perf_counter()
        sse = SSEStream(
            request,
            keepalive=self.keepalive_comments,
            error_after=self.error_after_chunks,
            error_event=dumps(self._stream_error_body("Internal server error", 500)),
        )
        await sse.open()
        emitted = {seq.position: 0 for seq in seqs}
        for seq in seqs:  # the scheduler aborts a refused prompt before its prefill
            if seq.refusal is not None:
                seq.sample = seq.sample.prefix(0)
        longest = max(len(seq.sample.token_ids) for seq in seqs)

        async def send(seq: _Seq, end: int, finished: bool, aborted: bool) -> bool:
            start = emitted[seq.position] if self.incremental_streaming_output else 0
            first = emitted[seq.position] == 0
            emitted[seq.position] = end
            s = seq.sample
            meta = self._meta_info(
                seq,
                body,
                start=start,
                end=end,
                finished=finished,
                aborted=aborted,
                flight=flight,
                elapsed=time.perf_counter() - started,
                first=first,
            )
            text = "".join(s.deltas[start:end])
            out = self._out(seq, body, text, list(s.token_ids[start:end]), meta)
            if not single:
                out["index"] = seq.position
            return await sse.send(dumps(out))

        async for step in self.steps(flight, longest):
            for seq in seqs:
                count = len(seq.sample.token_ids)
                if step < count and not await send(seq, step + 1, step + 1 == count, False):
                    return await sse.finish()
        for seq in seqs:  # aborted: every unfinished sequence ends with an abort reason
            if seq.refusal is not None or emitted[seq.position] < len(seq.sample.token_ids):
                end = emitted[seq.position]
                seq.sample = seq.sample.prefix(end)
                if not await send(seq, end, True, True):
                    return await sse.finish()
        return await sse.finish()

    @staticmethod
    def _stream_error_body(message: str, code: int) -> JSON:
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": code,
                "retryable": False,
            }
        }

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        """A ValueError raised once streaming began: an error event, then `[DONE]`, on a 200."""
        sse = SSEStream(request, keepalive=False, error_after=None, error_event=b"")
        await sse.open()
        await sse.send(dumps(self._stream_error_body(message, 400)))
        return await sse.finish()
