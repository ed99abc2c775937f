"""Regression tests for what fuzzing the capture side found (tests/capture/test_fuzz.py):
each input here once lost a record, a call, a whole store's worth of records, or a request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from support.proxies import all_calls, raw_post, running_proxy, scripted_upstream, trajectories

from trace_proxy.capture.exchange import Exchange
from trace_proxy.capture.metadata import MetadataResolver
from trace_proxy.capture.sse import iter_data
from trace_proxy.capture.stage import CaptureStage
from trace_proxy.metrics import Metrics
from trace_proxy.safejson import TOO_DEEP
from trace_proxy.store.names import store_name
from trace_proxy.trajectories.assembler import Assembler
from trace_proxy.trajectories.inference import TrafficInference
from trace_proxy.trajectories.record import GenerateCall, Record, Trajectory, dumps, ids_list

INLINE = {"capture_mode": "inline", "export_mode": "inline"}
COMPLETION = {"id": "c", "choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}
DEEP = b"[" * 300 + b"]" * 300  # JSON orjson reads (1,024 levels) but cannot write (255)


async def answer(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.json_response(COMPLETION)


def stage() -> tuple[CaptureStage, list[GenerateCall], list[Record]]:
    """A capture stage over a real assembler; the calls it was given, the records it built."""
    records: list[Record] = []
    calls: list[GenerateCall] = []
    assembler = Assembler(records.append, project="p", experiment="e", idle_timeout=300,
                          inference=TrafficInference())  # fmt: skip
    add_call = assembler.add_call

    def noted(hints: Any, call: GenerateCall, **kw: Any) -> None:
        calls.append(call)
        add_call(hints, call, **kw)

    assembler.add_call = noted  # type: ignore[method-assign]
    capture = CaptureStage(MetadataResolver([]), assembler, Metrics(), project="p",
                           experiment="e", queue_size=10, idle_check_interval=60)  # fmt: skip
    return capture, calls, records


def exchange(path: str, request: bytes, response: bytes, **fields: Any) -> Exchange:
    return Exchange(
        method="POST", path=path, query="", request_headers=CIMultiDictProxy(CIMultiDict()),
        path_metadata=[], upstream="http://u", start=1.0, request_body=request, status=200,
        response_headers=CIMultiDict({"Content-Type": "application/json"}),
        response_chunks=[response], **fields,
    )  # fmt: skip


# --- records that could not be written ---------------------------------------------------------


async def test_nesting_deeper_than_a_record_holds_no_longer_stops_the_spool(
    tmp_path: Path,
) -> None:
    """A request nested 300 deep (valid JSON) made its record fail to encode, which ended the
    task writing the spool: no record after it was written again. Now the deep part is
    replaced by a note, and the calls after it are recorded as before."""
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": ' + DEEP + b"}"
    async with (
        scripted_upstream(answer) as up,
        running_proxy([up], tmp_path, **INLINE) as (service, proxy),
    ):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        for i, body in enumerate((deep, orjson.dumps({"messages": []}))):
            tid = b"X-Rollout-Trajectory-Id: t%d\r\nX-Rollout-Done: 1\r\n" % i
            assert await raw_post(proxy, head + tid, body) == b"HTTP/1.1 200 OK"
        await service.flush()
    calls = {t["key"]["trajectory_id"]: t["calls"] for t in trajectories(tmp_path)}
    assert sorted(calls) == ["t0", "t1"]
    assert TOO_DEEP.encode() in orjson.dumps(calls["t0"][0]["sampling"])


def test_a_record_with_text_that_is_not_utf8_is_written() -> None:
    """aiohttp decodes header bytes that are not UTF-8 as lone surrogates, which orjson
    refuses: the record, and the batch of records spooled with it, could not be written."""
    capture, _, records = stage()
    sent = exchange("/v1/completions", b'{"prompt": "a"}', orjson.dumps(COMPLETION))
    sent.request_headers = CIMultiDictProxy(CIMultiDict({"X-Note": "caf\udce9"}))
    capture.process(sent)
    capture._assembler.close_all()
    [record] = [r for r in records if isinstance(r, Trajectory)]
    assert orjson.loads(dumps(record))["calls"][0]["request_headers"] == {"x-note": "caf\ufffd"}


@pytest.mark.parametrize("mode", ["process", "inline"])
async def test_key_headers_that_are_not_utf8_neither_fail_the_request_nor_lose_the_call(
    tmp_path: Path, mode: str
) -> None:
    """With a sampler, such a header's value was hashed as it was: the proxy answered 500
    without forwarding (capture inline), or lost the exchange on its way to the capture
    process (the frame could not be encoded). Now the value is read with U+FFFD."""
    async with (
        scripted_upstream(answer) as up,
        running_proxy(
            [up], tmp_path, capture_mode=mode, export_mode="inline", max_samples_per_step=4
        ) as (service, proxy),  # fmt: skip
    ):
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Rollout-Experiment: caf\xe9\r\n"
            b"X-Rollout-Step: 1\r\nX-Rollout-Sample-Index: 0\r\nX-Rollout-N: 0\r\n"
            b"X-Rollout-Done: 1\r\nX-Note: \xff\xfe\r\n"
        )
        assert await raw_post(proxy, head, b'{"prompt": "a"}') == b"HTTP/1.1 200 OK"
        await service.flush()
    [call] = all_calls(tmp_path)
    assert call["request_headers"]["x-note"] == "\ufffd\ufffd"
    [trajectory] = trajectories(tmp_path)
    assert trajectory["key"]["experiment"] == "caf\ufffd"


def test_a_step_too_large_for_a_record_is_malformed_not_recorded() -> None:
    """`X-Rollout-Step: 99999999999999999999` was kept as an integer no record can hold."""
    hints = MetadataResolver([]).resolve(
        CIMultiDict({"X-Rollout-Step": "99999999999999999999", "X-Rollout-N": "2"}), [], None
    )
    assert hints.values == {"rollout_n": 2}
    [note] = hints.annotations
    assert note["field"] == "step"


async def test_a_project_name_cannot_make_the_store_write_outside_its_directory(
    tmp_path: Path,
) -> None:
    """Project and experiment names from headers were used as directories as they were:
    `../..` left the store, `/etc` was an absolute path."""
    store = tmp_path / "store"
    async with (
        scripted_upstream(answer) as up,
        running_proxy([up], store, **INLINE) as (service, proxy),
    ):
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Rollout-Project: ../escaped\r\n"
            b"X-Rollout-Experiment: ..\r\nX-Rollout-Done: 1\r\nX-Rollout-Trajectory-Id: t\r\n"
        )
        assert await raw_post(proxy, head, b'{"prompt": "a"}') == b"HTTP/1.1 200 OK"
        await service.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    [trajectory] = trajectories(store)
    assert trajectory["key"]["project"] == "../escaped"
    assert (store / "%2E.%2Fescaped" / "%2E.").is_dir()


def test_store_names_are_one_plain_directory_name() -> None:
    assert store_name("grpo-qwen2.5_7b") == "grpo-qwen2.5_7b"  # what the options accept
    assert store_name("/etc") == "%2Fetc"
    assert store_name(".") == "%2E"
    assert store_name("a%2Fb") == "a%252Fb"  # no two names share a directory
    long = store_name("é" * 256)
    assert len(long.encode()) <= 200 and long != store_name("é" * 255)


# --- calls that were lost, or lost their prompts ------------------------------------------------


async def test_token_counts_that_are_not_numbers_no_longer_stop_capture(tmp_path: Path) -> None:
    """`"usage": {"prompt_tokens": "many"}` made building the trajectory raise inside the
    task that parses every exchange: capture stopped for good. (A client cannot send it; an
    upstream or a tool route can.)"""

    async def odd_usage(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({**COMPLETION, "usage": {"prompt_tokens": "many"}})

    async with (
        scripted_upstream(odd_usage) as up,
        running_proxy([up], tmp_path, **INLINE) as (service, proxy),
    ):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Rollout-Done: 1\r\n"
        for i in range(2):
            tid = b"X-Rollout-Trajectory-Id: t%d\r\n" % i
            assert await raw_post(proxy, head + tid, b'{"prompt": "a"}') == b"HTTP/1.1 200 OK"
        await service.flush()
    assert sorted(t["key"]["trajectory_id"] for t in trajectories(tmp_path)) == ["t0", "t1"]


@pytest.mark.parametrize(
    ("path", "request_body", "response"),
    [
        ("/v1/chat/completions", b'{"messages": []}', b'{"choices": [1]}'),
        ("/v1/chat/completions", b'{"messages": []}', b'{"choices": [{"message": "hi"}]}'),
        ("/v1/chat/completions", b'{"messages": []}',
         b'{"choices": [{"message": {"tool_calls": [{"function": "f"}]}}]}'),
        ("/v1/chat/completions", b'{"messages": []}',
         b'{"choices": [{"logprobs": {"content": [{"logprob": "low"}]}}]}'),
        ("/v1/completions", b'{"prompt": "a"}', b'{"choices": [{"index": "first"}]}'),
        ("/inference/v1/generate", b'{"token_ids": [1]}', b'{"choices": [null, []]}'),
        ("/generate", b'{"text": "a"}', b'{"text": 5, "meta_info": []}'),
        ("/generate", b'{"text": "a"}',
         b'{"meta_info": {"output_token_logprobs": [["x", 1]], "completion_tokens": "2"}}'),
    ],
)  # fmt: skip
def test_a_response_of_the_wrong_shape_is_recorded_unparsed_with_its_prompt(
    path: str, request_body: bytes, response: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Any field of the wrong type made the parser raise (AttributeError, TypeError,
    ValueError): the call was recorded as a 'parser error' without its prompt, and the error
    logged with a traceback. Now it is the response's fault, said in `unparsed`, or the odd
    field is left out, and the call keeps what the request said."""
    capture, calls, _ = stage()
    with caplog.at_level(logging.ERROR):
        capture.process(exchange(path, request_body, response))
    [call] = calls
    assert not (call.unparsed or "").startswith("parser error")
    assert (
        call.prompt.text == "a"
        or call.prompt.messages == []
        or ids_list(call.prompt.token_ids) == [1]
    )
    assert not caplog.records


def test_a_batch_whose_response_cannot_be_read_keeps_a_call_per_prompt() -> None:
    """An upstream cut off mid-response (status 200, half a body) gave one unparsed call with
    no prompt for the whole batch; now each prompt is a call, unparsed, saying why."""
    capture, calls, _ = stage()
    capture.process(exchange("/v1/completions", b'{"prompt": ["a", "b", [1, 2]]}',
                             b'{"choices": [{"index": 0, "te', error="upstream reset"))  # fmt: skip
    assert [c.prompt.text or c.prompt.token_ids for c in calls] == ["a", "b", [1, 2]]
    assert all(c.unparsed and c.unparsed.startswith("response is not JSON") for c in calls)


def test_a_negative_choice_index_is_not_the_last_prompts() -> None:
    """`"index": -1` gave the choice to the batch's last prompt (a list index from the end)."""
    capture, calls, _ = stage()
    capture.process(exchange("/v1/completions", b'{"prompt": ["a", "b"]}',
                             b'{"choices": [{"index": -1, "text": "x"}]}'))  # fmt: skip
    assert [(c.outputs, c.unparsed) for c in calls] == [([], "choice index -1 is negative")] * 2


def test_a_huge_n_no_longer_hangs_sglang_parsing() -> None:
    """`"n": 10**12` in a request made the parser list every (prompt, sample) pair before
    matching the response's objects to them: minutes and gigabytes, for one call."""
    capture, calls, _ = stage()
    request = b'{"input_ids": [1, 2], "sampling_params": {"n": 1000000000000}}'
    response = b'[{"text": "a", "output_ids": [3]}, {"text": "b", "output_ids": [4]}]'
    started = time.perf_counter()
    capture.process(exchange("/generate", request, response))
    assert time.perf_counter() - started < 1
    [call] = calls
    assert [o.text for o in call.outputs] == ["a", "b"]


def test_sglang_per_prompt_lists_shorter_than_the_batch() -> None:
    """`sampling_params` or `rid` lists shorter than the batch raised IndexError: the batch
    became one 'parser error' call."""
    capture, calls, _ = stage()
    request = b'{"input_ids": [[1], [2]], "sampling_params": [{"n": 1}], "rid": ["a"]}'
    response = b'[{"text": "x", "output_ids": [3]}, {"text": "y", "output_ids": [4]}]'
    capture.process(exchange("/generate", request, response))
    assert [(c.prompt.token_ids, [o.text for o in c.outputs]) for c in calls] == [
        ([1], ["x"]),
        ([2], ["y"]),
    ]


def test_a_chat_message_with_a_list_for_a_role_is_recorded_without_keys() -> None:
    """Traffic without key headers is grouped by its messages, used as dictionary keys: a
    role or tool-call name that was a list or an object raised TypeError, and the call was
    lost."""
    capture, calls, records = stage()
    request = b'{"messages": [{"role": ["user"], "content": {"a": 1}, "tool_calls": [1]}]}'
    capture.process(exchange("/v1/chat/completions", request, orjson.dumps(COMPLETION)))
    capture._assembler.close_all()
    assert len(calls) == 1
    assert [len(r.calls) for r in records if isinstance(r, Trajectory)] == [1]


def test_a_legacy_list_of_texts_is_kept_and_nothing_builds_on_it() -> None:
    """vLLM's legacy `/generate` answers `{"text": [prompt + output]}`, which the record keeps
    as it came; keyless grouping added that list to the prompt's text (TypeError: the call
    was lost), and so did resuming an aborted call."""
    capture, calls, records = stage()
    response = b'{"text": ["a b"], "meta_info": {"finish_reason": {"type": "abort"}}}'
    for prompt in (b'{"text": "a"}', b'{"text": "a"}'):
        capture.process(exchange("/generate", prompt, response))
    capture._assembler.close_all()
    assert [c.outputs[0].text for c in calls] == [["a b"], ["a b"]]
    assert sum(len(r.calls) for r in records if isinstance(r, Trajectory)) == 2


def test_every_line_ending_of_event_streams_is_read() -> None:
    """A lone CR ends a line in an event stream as CRLF and LF do; only LF and CRLF were
    read, so a stream written with CR gave no events."""
    for newline in (b"\n", b"\r\n", b"\r"):
        stream = b"data: a" + newline * 2 + b": comment" + newline + b"data: b" + newline * 2
        assert list(iter_data(stream)) == [b"a", b"b"]
