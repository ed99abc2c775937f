"""The verl plugin's parts that need no verl: request mapping, settings, and the link to the
proxy (registration, tagging, closing), against a real proxy and the simulated vLLM.

What verl's servers do with a generate (verl 0.9.1 `vllm_async_server.py` and
`async_sglang_server.py`) is the reference for the mapping; the full path with verl itself is
tests/real/test_verl_plugin.py.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.vllm import FakeVLLM
from support.proxies import running_proxy, trajectories

from trace_proxy.integrations.verl.admission import Admission
from trace_proxy.integrations.verl.link import ProxyLink, ProxyUnreachable, TrajectoryTags
from trace_proxy.integrations.verl.mapping import (
    ServerLimits,
    UnexpectedAnswer,
    sglang_request,
    sglang_result,
    unsupported_sampling,
    vllm_request,
    vllm_result,
    vllm_stop_reason,
)
from trace_proxy.integrations.verl.settings import PluginConfigError, read_settings

LIMITS = ServerLimits("vllm", prompt_length=100, response_length=30, max_model_len=120)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
            "logprobs": True}  # fmt: skip
TOKEN = "t0ken"


@pytest.fixture
def closed_url() -> Iterator[str]:
    """An address nothing answers on, whatever runs on the machine: a port held by a socket
    that never listens, so a connection is refused at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


def test_default_max_tokens_is_verls() -> None:
    # response_length, unless prompt + response length leaves less, then the context.
    assert vllm_request([1] * 10, SAMPLING, LIMITS, request_id="r")["max_tokens"] == 30
    assert vllm_request([1] * 80, SAMPLING, LIMITS, request_id="r")["max_tokens"] == 30
    assert vllm_request([1] * 95, SAMPLING, LIMITS, request_id="r")["max_tokens"] == 25
    assert vllm_request([1] * 115, SAMPLING, LIMITS, request_id="r")["max_tokens"] == 5
    assert vllm_request([1] * 119, SAMPLING, LIMITS, request_id="r")["max_tokens"] == 1
    explicit = vllm_request([1] * 10, {**SAMPLING, "max_new_tokens": 7}, LIMITS, request_id="r")
    assert explicit["max_tokens"] == 7 and "max_new_tokens" not in explicit
    with pytest.raises(ValueError, match="no room"):
        vllm_request([1] * 120, SAMPLING, LIMITS, request_id="r")


def test_vllm_request_carries_what_verls_server_sets() -> None:
    limits = ServerLimits("vllm", 100, 30, 120, ignore_eos=True, repetition_penalty=1.1)
    body = vllm_request([5, 6], {"temperature": 0, "logprobs": False}, limits,
                        request_id="abc", priority=3)  # fmt: skip
    assert body == {"prompt": [5, 6], "max_tokens": 30, "temperature": 0, "logprobs": None,
                    "repetition_penalty": 1.1, "ignore_eos": True, "return_token_ids": True,
                    "request_id": "abc", "priority": 3}  # fmt: skip
    sampling = {"temperature": 0, "logprobs": True}
    vllm_request([5], sampling, limits, request_id="a")
    assert sampling == {"temperature": 0, "logprobs": True}  # the caller's dict is left alone
    assert vllm_request([5], sampling, limits, request_id="a")["logprobs"] == 0


def test_vllm_answer_becomes_verls_token_output() -> None:
    answer = {"choices": [{"index": 0, "text": " Paris.", "finish_reason": "length",
                           "logprobs": {"token_logprobs": [-0.0123, -0.51]},
                           "token_ids": [12095, 13]}],
              "usage": {"prompt_tokens": 5,
                        "prompt_tokens_details": {"cached_tokens": 4}}}  # fmt: skip
    result = vllm_result(answer)
    assert (result.token_ids, result.log_probs, result.stop_reason) == (
        [12095, 13], [-0.0123, -0.51], "completed")  # fmt: skip
    assert result.num_cached_tokens == 4
    assert [vllm_stop_reason(r) for r in ("stop", "length", "abort", "tool_calls", None)] == [
        "completed", "completed", "aborted", "tool_calls", None]  # fmt: skip
    with pytest.raises(UnexpectedAnswer):
        vllm_result({"choices": [{"text": "no ids"}]})
    answer["choices"][0]["logprobs"] = {"token_logprobs": [-1.0]}
    with pytest.raises(UnexpectedAnswer, match="length"):
        vllm_result(answer)


def test_sglang_mapping_is_verls() -> None:
    limits = ServerLimits("sglang", 100, 30, 120)
    body = sglang_request([1] * 110, {"temperature": 0, "logprobs": True}, limits, request_id="r")
    assert body == {"rid": "r", "input_ids": [1] * 110, "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 9}}  # fmt: skip
    answer = {"text": " Paris.", "output_ids": [12095, 13],
              "meta_info": {"finish_reason": {"type": "length", "length": 2},
                            "output_token_logprobs": [[-0.0123, 12095, None],
                                                      [-0.51, 13, None]]}}  # fmt: skip
    result = sglang_result(answer, return_logprob=True)
    assert (result.token_ids, result.log_probs, result.stop_reason) == (
        [12095, 13],
        [-0.0123, -0.51],
        "length",
    )  # fmt: skip  (verl keeps SGLang's type)
    answer["meta_info"]["output_token_logprobs"] = []
    assert sglang_result(answer, return_logprob=True).token_ids == []  # verl drops them too


def test_sampling_params_http_cannot_carry_go_verls_way() -> None:
    assert unsupported_sampling("vllm", SAMPLING) is None
    assert unsupported_sampling("vllm", {**SAMPLING, "guided_json": {}}) == "guided_json"
    assert unsupported_sampling("sglang", {**SAMPLING, "seed": 1}) == "seed"


def _config(**trace: Any) -> dict[str, Any]:
    return {
        "trainer": {"project_name": "proj", "experiment_name": "exp", "use_v1": True},
        "actor_rollout_ref": {
            "model": {"path": "/nonexistent/model"},
            "rollout": {"agent": {"num_workers": 4}, "trace": trace},
        },
    }


def test_verls_trace_settings_keep_their_meaning(tmp_path: Path) -> None:
    settings = read_settings(_config(backend="mlflow", token2text=True,
                                     max_samples_per_step_per_worker=2,
                                     project_name="traces", experiment_name="run-7"))  # fmt: skip
    assert (settings.project, settings.experiment) == ("traces", "run-7")
    args = settings.proxy_args
    assert args[:4] == ["--backend", "jsonl", "--backend", "mlflow"]
    # N samples per worker and step: N x agent.num_workers per step.
    assert args[args.index("--max-samples-per-step") + 1] == "8"
    assert "--token2text" in args and "--tokenizer" not in args  # not a local directory
    config = _config(token2text=True)
    config["actor_rollout_ref"]["model"]["path"] = str(tmp_path)
    config["trace_proxy"] = {"output": "/data/traces", "max_samples_per_step": 3}
    args = read_settings(config).proxy_args
    assert args[args.index("--tokenizer") + 1] == str(tmp_path)
    assert args[args.index("--max-samples-per-step") + 1] == "3"  # ours wins
    assert read_settings(_config()).project == "proj"


def test_bad_plugin_settings_are_clear_errors() -> None:
    with pytest.raises(PluginConfigError, match="unknown trace_proxy key"):
        read_settings({**_config(), "trace_proxy": {"bakcend": "mlflow"}})
    with pytest.raises(PluginConfigError, match="admin_url"):
        read_settings({**_config(), "trace_proxy": {"url": "http://127.0.0.1:8100"}})
    with pytest.raises(PluginConfigError, match="no trace-proxy backend"):
        read_settings(_config(backend="wandb"))


@pytest.mark.parametrize(
    "ours",
    [
        {"sample_seed": -3, "validate_max_samples_per_step": 1, "tool_parser": "qwen3_coder",
         "args": ["--backend", "otlp", "--sample-seed", "7", "--otlp-header", "a=b,c"]},
        {"backend": [], "sample_seed": [1, 2], "log_level": "debug", "args": "--token2text"},
    ],
)  # fmt: skip
def test_the_plugins_view_of_its_proxies_settings_is_what_their_command_line_resolves_to(
    ours: dict[str, Any],
) -> None:
    """The plugin chooses each step's samples with its proxies' sampling options: resolved from
    the values their command line is written from (flags from the option table), with
    `trace_proxy.args` on top as a proxy takes them (repeated options add up, a later wins)."""
    from trace_proxy.cli import build_parser
    from trace_proxy.config import resolve, values_may_start_with_dash

    config = _config(backend="mlflow", max_samples_per_step_per_worker=2)
    config["trace_proxy"] = ours
    settings = read_settings(config, {})
    argv = values_may_start_with_dash(["serve", *settings.proxy_args])
    parsed = vars(build_parser().parse_args(argv))
    parsed.pop("command")
    assert settings.proxy_settings() == resolve("serve", parsed)


def test_trace_proxy_args_come_after_the_plugins_options() -> None:
    config = _config(backend="mlflow", max_samples_per_step_per_worker=2)
    config["trace_proxy"] = {
        "sample_seed": -3, "validate_max_samples_per_step": 1, "tool_parser": "qwen3_coder",
        "args": ["--backend", "otlp", "--sample-seed", "7", "--otlp-header", "a=b,c"],
    }  # fmt: skip
    proxy = read_settings(config, {}).proxy_settings()
    assert (proxy.sample_seed, proxy.max_samples_per_step, proxy.validate_max_samples_per_step,
            proxy.tool_parser) == (7, 8, 1, "qwen3_coder")  # fmt: skip
    assert (proxy.backend, proxy.otlp_header) == (["jsonl", "mlflow", "otlp"], ["a=b,c"])


def _tags(trajectory_id: str, n: int = 0) -> TrajectoryTags:
    return TrajectoryTags(project="proj", experiment="exp", step=4, sample_index=2, rollout_n=n,
                          validate=False, trajectory_id=trajectory_id,
                          sample_id="uid-2")  # fmt: skip


def test_the_link_travels_without_its_session_and_never_shows_its_token() -> None:
    link = ProxyLink("http://127.0.0.1:1", "http://127.0.0.1:2", TOKEN, LIMITS)
    copied = pickle.loads(pickle.dumps(link))
    assert (copied.admin_token, copied.limits, copied._session) == (TOKEN, LIMITS, None)
    assert TOKEN not in repr(link)


async def test_generate_through_the_proxy_is_tagged_and_closed(
    tmp_path: Path, qwen_tokenizer: Any, start_fake: Any
) -> None:
    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    upstream = await start_fake(fake)
    server_id = upstream.removeprefix("http://")
    settings = {"register_upstreams": True, "admin_token": TOKEN}
    async with running_proxy([], tmp_path, **settings) as (service, proxy_url):
        admin = service.addresses.admin  # type: ignore[union-attr]
        link = ProxyLink(proxy_url, admin, TOKEN, LIMITS)
        prompt = qwen_tokenizer.encode("Say hi")
        calls = [
            link.generate(
                server_id,
                _tags(f"t{n}", n),
                prompt,
                dict(SAMPLING),
                request_id=f"r{n}",
                weight_version=7 + n,
            )
            for n in range(2)
        ]
        results = await asyncio.gather(*calls)
        for result in results:
            assert result.token_ids and len(result.log_probs or []) == len(result.token_ids)
            assert result.stop_reason == "completed"
        await link.end_trajectory(_tags("t0"), reward=0.25)
        await service.flush()
        # A server that is not registered (or a wrong token) never becomes reachable.
        stranger = ProxyLink(proxy_url, admin, "wrong", LIMITS)
        with pytest.raises(ProxyUnreachable, match="401"):
            await stranger.generate("127.0.0.1:9", _tags("t9"), prompt, dict(SAMPLING),
                                    request_id="x")  # fmt: skip
        assert not link.fallbacks and link._session is not None
        await link._session.close()
        if stranger._session is not None:
            await stranger._session.close()
    records = trajectories(tmp_path)
    by_n = {r["key"]["rollout_n"]: r for r in records}
    assert set(by_n) == {0, 1}
    first = by_n[0]
    assert first["key"]["step"] == 4 and first["key"]["sample_index"] == 2
    assert first["key"]["sources"]["step"] == "header:X-Rollout-Step"
    assert first["close_reason"] == "done" and first["reward"] == 0.25
    assert first["calls"][0]["upstream"] == upstream
    assert first["calls"][0]["outputs"][0]["token_ids"] == results[0].token_ids
    # The version verl's server would return with each call, and verl's uid of the sample.
    assert [by_n[n]["calls"][0]["weight_version"] for n in (0, 1)] == ["7", "8"]
    assert [by_n[n]["key"]["sample_id"] for n in (0, 1)] == ["uid-2", "uid-2"]
    assert by_n[1]["close_reason"] == "shutdown"  # never told done: closed when the proxy stops


async def test_an_unreachable_proxy_is_reported_not_raised_as_a_server_error(
    closed_url: str,
) -> None:
    link = ProxyLink(closed_url, closed_url, TOKEN, LIMITS)
    with pytest.raises(ProxyUnreachable):
        await link.generate("127.0.0.1:1", _tags("t"), [1, 2], dict(SAMPLING), request_id="r")
    await link.end_trajectory(_tags("t"), None)  # never raises: counted
    assert link.fallbacks["close_unreachable"] == 1
    if link._session is not None:
        await link._session.close()


def test_without_verl_the_plugin_says_so_at_start() -> None:
    import importlib.util

    from trace_proxy.integrations.verl import AgentLoopManager
    from trace_proxy.integrations.verl.manager import UnsupportedVerl

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here; its version check runs in tests/real")
    with pytest.raises(UnsupportedVerl, match="verl is not installed"):
        AgentLoopManager.create(config={}, llm_client=None)


def test_the_core_never_imports_verl_or_the_integration() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trace_proxy.cli, trace_proxy.proxy.service, trace_proxy.processes.recorder;"
        "import trace_proxy.integrations.verl;"  # the class path verl loads: still no verl
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray', 'torch')"
        " or m.startswith('trace_proxy.integrations.verl.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_manager_keeps_the_n_smallest_keyed_hashes_as_one_proxy_would() -> None:
    from trace_proxy.integrations.verl.sampling import StepChooser
    from trace_proxy.trajectories.sampler import Policy, Sampler

    chooser = StepChooser(seed=7, experiment="exp", max_samples=3, validate_max_samples=None)
    batch = [i for i in range(20) for _ in range(4)]  # 20 samples x 4 rollouts, as verl's rows
    kept = chooser.choose(5, False, batch)
    assert kept is not None and len(kept) == 3
    # the same as one proxy's own top-N over the whole step
    sampler = Sampler(7, train=Policy(max_samples=3))
    for sample in range(20):
        sampler.decide("exp", 5, False, sample)
    assert {str(k) for k in kept} == sampler.finish_step("exp", 5, False)
    assert StepChooser(7, "exp", 3, None).choose(5, False, reversed(batch)) == kept  # any order
    assert chooser.choose(5, True, batch) is None  # validation keeps every sample here
    # a step whose batch comes in parts never keeps more than N
    parts = StepChooser(7, "exp", 3, None)
    first = parts.choose(6, False, range(10))
    assert first is not None and len(first) == 3
    assert parts.choose(6, False, range(10, 20)) == first


def test_outputs_and_text_for_tool_spans_come_from_the_plugin_settings(tmp_path: Path) -> None:
    config = _config()
    config["actor_rollout_ref"]["model"]["path"] = str(tmp_path)  # a local tokenizer
    config["trace_proxy"] = {"output": "/data/traces", "host": "10.0.0.7"}
    settings = read_settings(config)
    assert (settings.output, settings.host) == ("/data/traces", "10.0.0.7")
    assert "--output" not in settings.proxy_args and "--host" not in settings.proxy_args
    # decoded by default when the model's tokenizer is local: tool calls become tool spans
    assert "--token2text" in settings.proxy_args
    assert settings.proxy_args[settings.proxy_args.index("--tokenizer") + 1] == str(tmp_path)
    config["trace_proxy"] = {"token2text": False}
    assert "--token2text" not in read_settings(config).proxy_args
    assert "--token2text" not in read_settings(_config()).proxy_args  # no local tokenizer


def test_verls_default_token2text_is_not_a_users_choice(tmp_path: Path) -> None:
    """verl ships `trace.token2text: false`, and its composed config does not say who set a
    value: at verl's default it leaves decoding to the local tokenizer; only a value other
    than verl's, or `trace_proxy.token2text`, decides (tests/real/test_verl_settings.py runs
    this on verl's own composed config)."""
    shipped = {"backend": None, "token2text": False}  # verl 0.9.1's rollout.yaml

    def decoding(trace: dict[str, Any], ours: dict[str, Any], local: bool) -> list[str]:
        config = _config(**trace)
        if local:
            config["actor_rollout_ref"]["model"]["path"] = str(tmp_path)
        config["trace_proxy"] = ours
        args = read_settings(config, shipped).proxy_args
        return [a for a in args if a in ("--token2text", "--tokenizer")]

    on = ["--token2text", "--tokenizer"]
    assert decoding({"token2text": False}, {}, local=True) == on  # verl's default, not a choice
    assert decoding({}, {}, local=True) == on
    assert decoding({"token2text": False}, {}, local=False) == []  # nothing to decode with
    assert decoding({"token2text": True}, {}, local=False) == ["--token2text"]  # the user's
    assert decoding({"token2text": False}, {"token2text": False}, local=True) == []
    assert decoding({"token2text": True}, {"token2text": "false"}, local=True) == []  # ours wins
    # A verl that shipped true: its false would be the user's, and turn decoding off.
    config = _config(token2text=False)
    config["actor_rollout_ref"]["model"]["path"] = str(tmp_path)
    assert "--token2text" not in read_settings(config, {"token2text": True}).proxy_args


def test_verls_defaults_are_read_from_the_verl_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without verl, no default is known and verl's value is taken as set; with it, its
    rollout.yaml (where verl's trainer configs take the trace block from) says the default."""
    from trace_proxy.integrations.verl.settings import verl_trace_defaults

    assert verl_trace_defaults() == {}  # this venv has no verl
    rollout = tmp_path / "verl" / "trainer" / "config" / "rollout"
    rollout.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (rollout / "rollout.yaml").write_text(
        "name: ???\ntrace:\n  _target_: verl.workers.config.TraceConfig\n"
        "  project_name: ${oc.select:trainer.project_name,null}\n  token2text: False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert verl_trace_defaults()["token2text"] is False
    config = _config(token2text=False)
    config["actor_rollout_ref"]["model"]["path"] = str(tmp_path)
    assert "--token2text" in read_settings(config).proxy_args


async def test_each_server_goes_through_its_nodes_proxy_and_a_dead_one_is_routed_around(
    tmp_path: Path, qwen_tokenizer: Any, start_fake: Any, closed_url: str
) -> None:
    """Two proxies, one per "node"; the link sends each server's calls to its own, marks a
    proxy that stopped answering down (its calls then take verl's path) and closes each
    trajectory on the proxy its calls went through."""
    from trace_proxy.integrations.verl.link import Route

    fakes = [FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True) for _ in range(2)]
    servers = [(await start_fake(fake)).removeprefix("http://") for fake in fakes]
    options = {"register_upstreams": True, "admin_token": TOKEN}
    async with (
        running_proxy([], tmp_path / "a", **options) as (a, proxy_a),
        running_proxy([], tmp_path / "b", **options) as (b, proxy_b),
    ):
        admins = [s.addresses.admin for s in (a, b)]  # type: ignore[union-attr]
        routes = {servers[0]: Route(proxy_a, admins[0]), servers[1]: Route(proxy_b, admins[1])}
        link = pickle.loads(pickle.dumps(ProxyLink(None, None, TOKEN, LIMITS, routes=routes)))
        assert link.route("127.0.0.1:1") is None  # no proxy known: verl's path
        prompt = qwen_tokenizer.encode("Say hi")
        for n, server in enumerate(servers):
            await link.generate(server, _tags(f"t{n}", n), prompt, dict(SAMPLING),
                                request_id=f"r{n}")  # fmt: skip
            await link.end_trajectory(_tags(f"t{n}", n), 1.0, [link.route(server).admin_url])
        await a.flush()
        await b.flush()
        dead = Route(closed_url, closed_url)
        with pytest.raises(ProxyUnreachable):
            await link.generate(servers[0], _tags("t9"), prompt, dict(SAMPLING),
                                request_id="r9", route=dead)  # fmt: skip
        link.mark_down(ProxyUnreachable("gone"), dead)
        assert not link.usable(dead) and link.usable(link.route(servers[0]))
        assert link.fallbacks["proxy_unreachable"] == 1
        assert link._session is not None
        await link._session.close()
    for output, server in zip(("a", "b"), servers, strict=True):
        [record] = trajectories(tmp_path / output)
        assert record["close_reason"] == "done" and record["reward"] == 1.0
        assert record["calls"][0]["upstream"] == f"http://{server}"


class WorkerStandIn:
    """verl 0.9.1's v1 agent-loop worker as the tracing mixin meets it (`AgentLoopWorkerTQ`,
    verl/trainer/ppo/v1/agent_loop_tq.py, over verl/experimental/agent_loop/agent_loop.py):
    `_run_agent_loop` runs the agent loop, whose generates go through verl's LLM client (here
    as the plugin's transport sends them: tagged with the run, through the proxy, counted on
    it), then `_agent_loop_postprocess` computes the score (`_compute_score` sets
    `reward_score` on the last output) and puts the sample into the TransferQueue, where the
    trainer takes it; `_run_agent_loop` returns only after that."""

    def __init__(self, link: ProxyLink, server_id: str, prompt: list[int],
                 hand_over: Any) -> None:  # fmt: skip
        self.llm_client = type("Client", (), {"_trace_proxy_link": link})()
        self.server_id, self.prompt, self.hand_over = server_id, prompt, hand_over

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any],
                              **kwargs: Any) -> None:  # fmt: skip
        from trace_proxy.integrations.verl.context import CURRENT_RUN

        link: ProxyLink = self.llm_client._trace_proxy_link
        run = CURRENT_RUN.get()
        assert run is not None
        await link.generate(self.server_id, run.tags, self.prompt, dict(sampling_params),
                            request_id=f"r{kwargs['session_id']}")  # fmt: skip
        run.generates += 1
        run.admin_urls.add(str(link.admin_url))
        output = type("AgentLoopOutput", (), {"reward_score": None})()
        await self._compute_score([output], kwargs=kwargs)
        await self.hand_over(run.tags.trajectory_id)

    async def _compute_score(self, outputs: list[Any], kwargs: dict[str, Any]) -> None:
        outputs[-1].reward_score = 0.5


async def test_a_sample_is_closed_done_before_verl_hands_it_to_the_trainer(
    tmp_path: Path, qwen_tokenizer: Any, start_fake: Any
) -> None:
    """v1's worker gives the trainer each sample before `_run_agent_loop` returns: the trainer
    may end the run then. By that moment the proxy has the trajectory closed as done, with
    verl's reward, and it is closed once."""
    from trace_proxy.integrations.verl.worker import traced_worker_class

    fake = FakeVLLM(qwen_tokenizer, model="tiny-qwen", deterministic=True)
    server_id = (await start_fake(fake)).removeprefix("http://")
    settings = {"register_upstreams": True, "admin_token": TOKEN}
    async with running_proxy([], tmp_path, **settings) as (service, proxy_url):
        link = ProxyLink(proxy_url, service.addresses.admin, TOKEN, LIMITS)  # type: ignore[union-attr]
        closed_when_handed_over: dict[str, list[dict[str, Any]]] = {}

        async def hand_over(trajectory_id: str) -> None:  # what the trainer could see by now
            await service.flush()
            found = trajectories(tmp_path)
            closed_when_handed_over[trajectory_id] = [
                r for r in found if r["key"]["trajectory_id"] == trajectory_id
            ]

        worker_class = traced_worker_class(WorkerStandIn, "proj", "exp")
        worker = worker_class.__new__(worker_class)  # verl's __init__ needs verl's config
        WorkerStandIn.__init__(worker, link, server_id, qwen_tokenizer.encode("Say hi"), hand_over)
        trajectory = {"step": 4, "sample_index": 2, "rollout_n": 0, "validate": False}
        await asyncio.gather(*(worker._run_agent_loop(dict(SAMPLING), trajectory=trajectory,
                                                      session_id=n) for n in range(2)))  # fmt: skip
        await service.flush()
        assert link._session is not None
        await link._session.close()
    assert len(closed_when_handed_over) == 2
    for [record] in closed_when_handed_over.values():
        assert record["close_reason"] == "done" and record["reward"] == 0.5
    stored = [r for r in (json.loads(line) for path in tmp_path.rglob("*.jsonl")
                          for line in path.read_text().splitlines())]  # fmt: skip
    assert sorted(r["record"] for r in stored if r["record"] != "step_summary") == [
        "trajectory",
        "trajectory",
    ]  # closed once: no reward left over as an annotation


class _GatedServer:
    """verl 0.9.1's server actor state the plugin reads (`vllm_async_server.py`): the gate,
    whether it rejects late arrivals, `global_steps`; `syncs` plays a weight sync after the
    gate has been read closed that many times (the trainer's `set_global_steps` and resume)."""

    def __init__(self, closed: bool, rejecting: bool = False, syncs: int = 0) -> None:
        self._submission_paused, self._rejecting, self.global_steps = closed, rejecting, 3
        self.syncs, self.reads = syncs, 0

    async def call(self, fn: Any) -> Any:  # what `__ray_call__.remote(fn)` runs in the actor
        found = fn(self)
        self.reads += 1
        if self._submission_paused and self.reads == self.syncs:
            self.global_steps, self._submission_paused = 4, False
        return found

    @property
    def __ray_call__(self) -> Any:
        return type("Method", (), {"remote": staticmethod(self.call)})


async def test_a_call_is_admitted_with_the_version_in_force_once_the_gate_opens() -> None:
    """The version verl's server would return: read with its gate open; while a sync holds
    the gate closed the call waits for it, as verl's `generate` does, and gets the version the
    sync set; a gate that rejects late arrivals gives verl's `aborted` answer at once."""
    from trace_proxy.integrations.verl.admission import admit

    assert await admit(_GatedServer(closed=False)) == Admission(3, rejected=False)
    server = _GatedServer(closed=True, syncs=2)
    assert await admit(server) == Admission(4, rejected=False)
    assert server.reads == 3  # closed, closed (then the sync), open
    assert await admit(_GatedServer(closed=True, rejecting=True)) == Admission(3, rejected=True)


async def test_calls_arriving_together_share_a_read_that_starts_after_each_arrived() -> None:
    """Calls sent together ask a server once, no call gets a read that was under way before it
    arrived (a sync could have fallen between), and none waits for another's read to end."""
    from trace_proxy.integrations.verl.admission import GateReads, admit

    class Server:
        def __init__(self) -> None:
            self._submission_paused, self._rejecting, self.global_steps = False, False, 3
            self.started: list[asyncio.Future[None]] = []

        async def call(self, fn: Any) -> Any:
            answered = asyncio.get_running_loop().create_future()
            self.started.append(answered)
            found = fn(self)  # read as the read starts
            await answered
            return found

        @property
        def __ray_call__(self) -> Any:
            return type("Method", (), {"remote": staticmethod(self.call)})

    server, reads = Server(), GateReads()
    first = [asyncio.create_task(admit(server, reads, "s")) for _ in range(5)]
    while len(server.started) < 1:
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(server.started) == 1  # five calls sent together, one read
    server.global_steps = 4  # a sync completes while the first read is under way
    later = [asyncio.create_task(admit(server, reads, "s")) for _ in range(7)]
    while len(server.started) < 2:  # the later calls' own read, beside the first
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(server.started) == 2
    server.started[1].set_result(None)
    assert [a.version for a in await asyncio.gather(*later)] == [4] * 7
    server.started[0].set_result(None)
    assert [a.version for a in await asyncio.gather(*first)] == [3] * 5
    assert len(server.started) == 2
