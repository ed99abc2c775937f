"""`trace-proxy replay` against the simulated vLLM and the fake SGLang: the requests it sends are
the recorded ones (the model aside, when overridden), for every dialect, token-in and streamed
calls included, and the answers land in the store as a new run whose trajectories say which
recorded one each replays."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from fakes import FakeSGLang, FakeVLLM, StartFake
from support.proxies import closed_port, running_proxy, scripted_upstream, trajectories
from support.stores import append, call, run_dir, step_file, trajectory

from trace_proxy.cli import main
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.replay.requests import NotReplayable, ReplayCall, replay_calls
from trace_proxy.replay.selection import ReplayError, select
from trace_proxy.replay.session import ReplayPlan, replay

Json = dict[str, Any]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
PROMPT_IDS = [785, 6722, 315, 9625, 374]


def key_headers(step: int, sample: int, rollout: int, trajectory_id: str) -> dict[str, str]:
    return {"X-Rollout-Experiment": "grpo", "X-Rollout-Step": str(step),
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": str(rollout),
            "X-Rollout-Trajectory-Id": trajectory_id}  # fmt: skip


async def post(http: aiohttp.ClientSession, url: str, body: Json, headers: dict[str, str]) -> Any:
    """One call; the answer as JSON, or a streamed answer's events (the last one's ids merged
    by the caller when it needs them)."""
    async with http.post(url, json=body, headers=headers) as answer:
        data = await answer.read()
        assert answer.status == 200, data[:300]
    if body.get("stream"):
        return [orjson.loads(line[6:]) for line in data.split(b"\n")
                if line.startswith(b"data: {")]  # fmt: skip
    return orjson.loads(data)


def streamed_ids(events: list[Json]) -> list[int]:
    return [i for e in events for c in e.get("choices") or [] for i in c.get("token_ids") or []]


async def record_vllm_rollouts(proxy: str, model: str) -> None:
    """Three trajectories of step 1: a two-turn chat with tools (the second turn streamed),
    a two-turn token-in generate (the second streamed, its prompt the first's context plus
    a tool result's ids), and a streamed completions call on token ids."""
    async with aiohttp.ClientSession() as http:
        chat = {"model": model, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": TOOLS, "max_tokens": 24, "temperature": 0.7, "seed": 3,
                "logprobs": True, "stream": False}  # fmt: skip
        first = await post(http, proxy + "/v1/chat/completions", chat,
                           key_headers(1, 0, 0, "chat"))  # fmt: skip
        reply = first["choices"][0]["message"]
        chat["messages"] = [*chat["messages"], {"role": "assistant", "content": reply["content"]},
                            {"role": "user", "content": "And in Rome?"}]  # fmt: skip
        chat["stream"] = True
        await post(http, proxy + "/v1/chat/completions", chat, key_headers(1, 0, 0, "chat"))
        params = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
        generate = {"model": model, "token_ids": PROMPT_IDS, "stream": False,
                    "sampling_params": params}  # fmt: skip
        answer = await post(http, proxy + "/inference/v1/generate", generate,
                            key_headers(1, 1, 0, "tokens"))  # fmt: skip
        generate["token_ids"] = PROMPT_IDS + answer["choices"][0]["token_ids"] + [198, 13]
        generate["stream"] = True
        await post(http, proxy + "/inference/v1/generate", generate, key_headers(1, 1, 0, "tokens"))
        completions = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 5, "n": 2,
                       "temperature": 1.0, "seed": 11, "stream": True}  # fmt: skip
        await post(http, proxy + "/v1/completions", completions, key_headers(1, 2, 1, "text"))


async def record_sglang_rollouts(proxy: str) -> None:
    """A two-turn token-in trajectory on SGLang's /generate (the second streamed) and a text one."""
    async with aiohttp.ClientSession() as http:
        params = {"max_new_tokens": 6, "temperature": 0}
        body = {"input_ids": PROMPT_IDS, "sampling_params": params, "stream": False}
        first = await post(http, proxy + "/generate", body, key_headers(2, 0, 0, "sg"))
        body = {"input_ids": PROMPT_IDS + first["output_ids"] + [198], "sampling_params": params,
                "stream": True}  # fmt: skip
        await post(http, proxy + "/generate", body, key_headers(2, 0, 0, "sg"))
        text = {"text": "The capital of France is", "sampling_params": {**params, "n": 1},
                "stream": False}  # fmt: skip
        await post(http, proxy + "/generate", text, key_headers(2, 1, 0, "sg-text"))


def generate_bodies(fake: FakeVLLM | FakeSGLang) -> list[Json]:
    """The generate requests the fake received, in order."""
    routes = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate", "/generate")
    return [r.json() for r in fake.requests if r.method == "POST" and r.path in routes]


def canonical(bodies: list[Json]) -> list[bytes]:
    """Bodies as JSON values, in any order (trajectories are replayed side by side); a
    `stream` of false is the default, as good as none."""
    return sorted(
        orjson.dumps({k: v for k, v in body.items() if (k, v) != ("stream", False)},
                     option=orjson.OPT_SORT_KEYS)
        for body in bodies
    )  # fmt: skip


def by_replay_of(store: Path, experiment: str) -> dict[str, Json]:
    return {
        t["labels"]["replay_of"]: t for t in trajectories(store)
        if t["key"]["experiment"] == experiment
    }  # fmt: skip


async def test_vllm_calls_are_sent_as_recorded_and_land_as_a_new_run(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    recorded_fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    async with running_proxy([await start_fake(recorded_fake)], store) as (_, proxy):
        await record_vllm_rollouts(proxy, "tiny-qwen")
    originals = {t["id"]: t for t in trajectories(store)}
    assert len(originals) == 3

    newer = FakeVLLM(qwen_tokenizer, model="tiny-qwen-v2", deterministic=True)
    newer_url = await start_fake(newer)
    argv = ["replay", str(store), "--upstream", newer_url, "--step", "1",
            "--model", "tiny-qwen-v2", "--experiment", "grpo-v2", "--concurrency", "2"]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0

    sent = generate_bodies(newer)
    expected = [{**body, "model": "tiny-qwen-v2"} for body in generate_bodies(recorded_fake)]
    assert len(sent) == 5
    assert canonical(sent) == canonical(expected)
    replayed = by_replay_of(store, "grpo-v2")
    assert set(replayed) == set(originals)
    for original_id, new in replayed.items():
        original = originals[original_id]
        for name in ("project", "step", "sample_index", "rollout_n", "validate"):
            assert new["key"][name] == original["key"][name]
        assert new["labels"]["replay_of_experiment"] == "grpo"
        assert new["labels"]["replay_model"] == "tiny-qwen-v2"
        assert [c["dialect"] for c in new["calls"]] == [c["dialect"] for c in original["calls"]]
        assert [c["stream"] for c in new["calls"]] == [c["stream"] for c in original["calls"]]
        assert all(c["model"] == "tiny-qwen-v2" and c["outputs"] for c in new["calls"])
        assert new["upstreams"] == [newer_url]
    out = capsys.readouterr().out
    assert "3 trajectories of default/grpo: 5 calls sent, 0 failed, 0 not replayable" in out
    assert "New run default/grpo-v2: 3 trajectories written" in out
    assert f"trace-proxy ui {store}  (then /run/0/default/grpo-v2/" in out


async def test_sglang_calls_are_sent_as_recorded(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    recorded_fake = FakeSGLang(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    async with running_proxy([await start_fake(recorded_fake)], store) as (_, proxy):
        await record_sglang_rollouts(proxy)
    newer = FakeSGLang(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    newer_url = await start_fake(newer)
    run, picked = select(store, run_name="grpo", trajectory_ids=["sg", "sg-text"], step=None)
    plan = ReplayPlan(upstream=newer_url, output=tmp_path / "out", experiment="again",
                      tokenizer=[str(ensure_qwen_tokenizer())], token2text=True)  # fmt: skip
    report = await replay(run, picked, plan)

    assert (report.sent, report.failed, report.skipped, report.trajectories) == (3, [], [], 2)
    assert canonical(generate_bodies(newer)) == canonical(generate_bodies(recorded_fake))
    replayed = by_replay_of(tmp_path / "out", "again")
    assert {t["key"]["trajectory_id"] for t in replayed.values()} == set(replayed)
    tokens = next(t for t in replayed.values() if len(t["calls"]) == 2)
    assert [c["stream"] for c in tokens["calls"]] == [False, True]
    assert all(c["outputs"][0]["token_ids"] for c in tokens["calls"])
    first = tokens["calls"][0]  # decoded as serve --token2text decodes
    assert first["prompt_text"] == qwen_tokenizer.decode(PROMPT_IDS)
    assert first["outputs"][0]["response_text"] == qwen_tokenizer.decode(
        first["outputs"][0]["token_ids"]
    )


def test_a_call_whose_request_was_not_recorded_is_named_not_sent() -> None:
    unparsed = call(1, "x")
    unparsed.update(dialect="openai.chat", route="/v1/chat/completions",
                    unparsed="request is not JSON: unexpected character")  # fmt: skip
    unparsed["prompt"]["token_ids"] = None
    record = trajectory(calls=[call(0, "fine"), unparsed])
    rebuilt = replay_calls(record, extra={"return_token_ids": True})
    assert isinstance(rebuilt[0], ReplayCall)
    assert rebuilt[0].body == {"model": "m", "prompt": [1, 2, 3, 4, 5],
                               "return_token_ids": True}  # fmt: skip
    assert rebuilt[1] == NotReplayable(
        1, "no messages recorded: request is not JSON: unexpected character"
    )


def test_selection_names_what_is_missing(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = trajectory(ident="a" * 32)
    append(step_file(run_dir(store, "proj", "exp"), 1), first)
    replayed = trajectory(ident="b" * 32, experiment="other")
    replayed["key"]["trajectory_id"] = first["id"]  # a replay's: its recorded record's id
    append(step_file(run_dir(store, "proj", "other"), 1), replayed)
    run, picked = select(store, run_name=None, trajectory_ids=["a" * 32], step=None)
    assert (run.name, [t["id"] for t in picked]) == ("proj/exp", [first["id"]])
    run, picked = select(store, run_name="other", trajectory_ids=["a" * 32], step=None)
    assert (run.name, [t["id"] for t in picked]) == ("proj/other", [replayed["id"]])
    cases = {
        "no trajectory nope in the store": dict(run_name=None, trajectory_ids=["nope"], step=None),
        "the store holds several runs (proj/exp, proj/other)": dict(
            run_name=None, trajectory_ids=[], step=1),
        "no trajectories of step 2 in proj/exp": dict(run_name="exp", trajectory_ids=[], step=2),
        "no run 'x' in the store": dict(run_name="x", trajectory_ids=[], step=1),
        "name what to replay": dict(run_name=None, trajectory_ids=[], step=None),
    }  # fmt: skip
    for message, how in cases.items():
        with pytest.raises(ReplayError, match=re.escape(message)):
            select(store, **how)  # type: ignore[arg-type]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trace_proxy", "replay", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_command_line_refuses_with_one_line_and_exit_2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    append(step_file(run_dir(store), 1), trajectory(ident="c" * 32))
    unreachable = f"http://127.0.0.1:{closed_port()}"
    secret = "Bearer sk-never-shown"
    cases = [
        ((str(tmp_path / "none"), "--upstream", unreachable, "--step", "1"), "no store at"),
        ((str(store), "--upstream", unreachable, "--trajectory", "d" * 32), "no trajectory"),
        ((str(store), "--upstream", unreachable, "--step", "1", "--header",
          f"Authorization: {secret}"),
         "cannot reach the upstream"),
        ((str(store), "--upstream", "ftp://x", "--step", "1"), "invalid value for --upstream"),
        ((str(store), "--upstream", unreachable, "--step", "1", "--header", f"X {secret}"),
         "invalid value for --header"),
    ]  # fmt: skip
    for args, message in cases:
        done = cli(*args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
        assert "sk-never-shown" not in done.stderr + done.stdout


async def test_a_failed_call_is_named_with_its_reason_and_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    original = trajectory(ident="f" * 32)
    append(step_file(run_dir(store), 1), original)

    async def overloaded(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(text="ok")
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async with scripted_upstream(overloaded) as url:
        argv = ["replay", str(store), "--upstream", url, "--trajectory", original["id"]]
        assert await asyncio.to_thread(main, argv) == 1
    out = capsys.readouterr().out
    assert "1 calls sent, 1 failed" in out
    assert f"failed: trajectory {original['id']} call 0: HTTP 503: " in out and "overloaded" in out
    [new] = [
        t for t in trajectories(store) if (t["labels"] or {}).get("replay_of") == original["id"]
    ]
    assert new["key"]["experiment"].startswith("exp-replay-")
    assert new["calls"][0]["error"]["type"] == "http_503"


async def test_a_request_field_the_record_does_not_keep_is_named_and_can_be_given(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`return_token_ids` is no sampling parameter and the record does not keep it: replayed
    without it, the answers lack the token ids the recorded ones had, and the summary says
    which option sends it; with `--body-field` the request is the recorded one again."""
    store = tmp_path / "store"
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    url = await start_fake(fake)
    chat = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, "return_token_ids": True, "stream": False}  # fmt: skip
    async with running_proxy([url], store) as (_, proxy), aiohttp.ClientSession() as http:
        await post(http, proxy + "/v1/chat/completions", chat, key_headers(1, 0, 0, "t"))
    recorded = generate_bodies(fake)
    for given, missing in (([], 1), (["--body-field", "return_token_ids=true"], 0)):
        del fake.requests[:]
        argv = ["replay", str(store), "--upstream", url, "--trajectory", "t", "--run",
                "grpo", "--experiment", f"again-{missing}", *given]  # fmt: skip
        assert await asyncio.to_thread(main, argv) == 0
        out = capsys.readouterr().out
        hint = "1 replayed calls came back without the token ids their recorded call had"
        assert (hint in out) == bool(missing), out
        assert (canonical(generate_bodies(fake)) == canonical(recorded)) == (not missing)


async def test_the_demo_agents_openai_sdk_conversations_are_sent_again_exactly(
    qwen_tokenizer: Any, start_fake: StartFake, tmp_path: Path
) -> None:
    """The demo's tool-calling agent (the OpenAI SDK, replies sent back as the SDK builds them,
    tool results, streamed and whole turns): every turn's request is sent again as it was, so
    prefix sharing undone gives back each conversation exactly."""
    from openai import AsyncOpenAI

    from trace_proxy.demo.run import rollout

    store = tmp_path / "store"
    fake = FakeVLLM(qwen_tokenizer, model="qwen-sim", deterministic=True)
    url = await start_fake(fake)
    async with running_proxy([url], store) as (_, proxy):
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="never-recorded")
        turns = await asyncio.gather(*(
            rollout(client, "qwen-sim", 1, sample, 0, stream=sample % 2 == 1)
            for sample in range(4)
        ))  # fmt: skip
        await client.close()
    assert sum(t for t, _ in turns) > 4  # multi-turn: tools were called
    recorded = generate_bodies(fake)
    del fake.requests[:]
    run, picked = select(store, run_name=None, trajectory_ids=[], step=1)
    plan = ReplayPlan(upstream=url, output=store, experiment="again",
                      extra={"return_token_ids": True})  # fmt: skip
    report = await replay(run, picked, plan)
    assert (report.sent, report.failed, report.trajectories) == (len(recorded), [], 4)
    assert canonical(generate_bodies(fake)) == canonical(recorded)
    assert report.token_ids_missing == 0


async def test_an_interrupted_replay_stops_its_proxy_and_keeps_what_was_answered(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    original = trajectory(ident="e" * 32, calls=[call(0, "one"), call(1, "two", prompt_ids=[9])])
    append(step_file(run_dir(store), 1), original)
    second_call = asyncio.Event()

    async def answers_once(request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(text="ok")
        if (await request.json())["prompt"] == original["calls"][0]["prompt"]["token_ids"]:
            choice = {"index": 0, "text": "uno", "finish_reason": "stop"}
            return web.json_response({"id": "c", "choices": [choice]})
        second_call.set()
        await asyncio.Event().wait()  # never answers: the replay is interrupted meanwhile
        raise AssertionError("unreachable")

    async with scripted_upstream(answers_once) as url:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trace_proxy", "replay", str(store), "--upstream", url,
            "--step", "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            # Ctrl-C as a terminal delivers it, whatever this test process ignores.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        await asyncio.wait_for(second_call.wait(), 60)
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 130, err
    assert b"interrupted; the calls answered so far are recorded" in err
    [new] = [t for t in trajectories(store) if (t["labels"] or {}).get("replay_of")]
    assert [c["outputs"][0]["text"] if c["outputs"] else None for c in new["calls"]] == [
        "uno",
        None,
    ]
    assert new["calls"][1]["error"]["type"] == "transport"


async def test_a_store_of_replicas_gets_a_replica_of_the_replays_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Readers take a store that holds replicas as its replicas only: the new run is written
    as one more, and one viewer over the store sees both runs."""
    store = tmp_path / "store"
    original = trajectory(ident="9" * 32)
    append(step_file(run_dir(store / "replicas" / "node-a"), 1), original)

    async def answers(request: web.Request) -> web.Response:
        choice = {"index": 0, "text": "again", "finish_reason": "stop"}
        return web.json_response({"id": "c", "choices": [choice]})

    async with scripted_upstream(answers) as url:
        argv = ["replay", str(store), "--upstream", url, "--step", "1", "--experiment", "r"]
        assert await asyncio.to_thread(main, argv) == 0
    assert f"trace-proxy ui {store}  (then /run/0/proj/r/" in capsys.readouterr().out
    [new] = trajectories(store / "replicas" / "replay")
    assert new["labels"]["replay_of"] == original["id"]
    assert {t["key"]["experiment"] for t in trajectories(store)} == {"exp", "r"}
