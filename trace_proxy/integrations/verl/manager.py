"""Builds verl's own agent-loop manager with the tracing worker and transport in place.

verl loads `trace_proxy.integrations.verl.AgentLoopManager` by its path and calls `create`
with the arguments its trainer always passes; this module checks the verl version, starts a
proxy beside each rollout server (fleet.py; or finds the one given by URL), registers verl's
servers with it, puts the HTTP hop into verl's LLM client, and returns verl's v1
(`AgentLoopManagerTQ`) or legacy (`AgentLoopManager`) manager, whose workers are verl's own
with the tracing mixin on top, and whose `generate_sequences` first chooses the step's kept
samples for every proxy (sampling.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from trace_proxy.integrations.verl.fleet import ProxyFleet
from trace_proxy.integrations.verl.launcher import check_running, register_servers
from trace_proxy.integrations.verl.link import ProxyLink
from trace_proxy.integrations.verl.mapping import ServerLimits
from trace_proxy.integrations.verl.sampling import StepChooser, StepDecider
from trace_proxy.integrations.verl.settings import PluginSettings, read_settings
from trace_proxy.integrations.verl.transport import install
from trace_proxy.integrations.verl.worker import traced_worker_class

log = logging.getLogger(__name__)
SUPPORTED_VERL = ("0.9.",)  # tested with 0.9.1
ENGINES = ("vllm", "sglang")


class UnsupportedVerl(RuntimeError):
    """This verl (version, rollout engine or trainer) is not one the plugin supports."""


def check_version() -> str:
    try:
        import verl
    except ImportError:
        raise UnsupportedVerl("verl is not installed in this environment") from None
    version = str(getattr(verl, "__version__", "unknown"))
    if not version.startswith(SUPPORTED_VERL):
        raise UnsupportedVerl(
            f"trace-proxy's verl plugin supports verl {', '.join(v + 'x' for v in SUPPORTED_VERL)}"
            f" (tested with 0.9.1); this is verl {version}. Remove "
            "actor_rollout_ref.rollout.agent.agent_loop_manager_class to train without it."
        )
    return version


def server_limits(config: Any) -> ServerLimits:
    """What verl's servers apply to every generate, as its server code reads it."""
    rollout = config.actor_rollout_ref.rollout
    engine = str(rollout.name)
    if engine not in ENGINES:
        raise UnsupportedVerl(
            f"rollout.name={engine!r}: the plugin sends vllm and sglang rollouts through "
            "trace-proxy"
        )
    max_model_len = rollout.get("max_model_len")
    if max_model_len is None:
        from transformers import AutoConfig
        from verl.workers.rollout.utils import get_max_position_embeddings

        model = config.actor_rollout_ref.model
        hf_config = AutoConfig.from_pretrained(
            model.path, trust_remote_code=bool(model.get("trust_remote_code", False))
        )
        max_model_len = get_max_position_embeddings(hf_config)
    return ServerLimits(
        engine=engine,
        prompt_length=int(rollout.prompt_length),
        response_length=int(rollout.response_length),
        max_model_len=int(max_model_len),
        ignore_eos=bool(rollout.get("ignore_eos", False)),
        repetition_penalty=float(rollout.get("repetition_penalty", 1.0)),
    )


def is_fully_async(config: Any, llm_client: Any) -> bool:
    """verl's fully asynchronous rollouter's manager: its client and its config section."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    return isinstance(llm_client, FullyAsyncLLMServerClient) and "async_training" in config


def _variant(settings: PluginSettings, config: Any, llm_client: Any) -> str:
    if is_fully_async(config, llm_client):
        return "fully_async"  # whatever trace_proxy.manager says: no other manager runs it
    if settings.manager != "auto":
        return settings.manager
    for depth in range(2, 8):  # the one-step-off-policy trainer builds the legacy manager
        try:
            caller = sys._getframe(depth).f_globals.get("__name__", "")
        except ValueError:
            break
        if "one_step_off_policy" in caller:
            return "legacy"
    use_v1 = config.get("trainer", {}).get("use_v1", False)
    return "v1" if use_v1 else "legacy"


def _connect(
    settings: PluginSettings, llm_client: Any, limits: ServerLimits
) -> tuple[ProxyLink, ProxyFleet | None]:
    """The running proxy given by URL (a sidecar), with verl's servers registered; else a
    proxy started beside each rollout server (the link then routes each server to its own)."""
    if settings.url is not None:
        import ray

        assert settings.admin_url is not None
        check_running(settings.url, settings.admin_url, settings.admin_token)
        balancer = getattr(llm_client, "_load_balancer", None)
        if balancer is not None:
            servers = list(ray.get(balancer.get_all_servers.remote()))
            register_servers(settings.admin_url, settings.admin_token, servers)
        return ProxyLink(settings.url, settings.admin_url, settings.admin_token, limits), None
    args = [*settings.proxy_args, *(["--host", settings.host] if settings.host else [])]
    fleet = ProxyFleet.start(llm_client, args, settings.output, settings.start_timeout)
    return ProxyLink(None, None, fleet.admin_token, limits, routes=dict(fleet.routes)), fleet


def _decider(settings: PluginSettings, link: ProxyLink) -> StepDecider:
    """Who chooses each step's samples, with the sampling options the proxies were given."""
    proxy = settings.proxy_settings()
    chooser = StepChooser(proxy.sample_seed, settings.experiment, proxy.max_samples_per_step,
                          proxy.validate_max_samples_per_step)  # fmt: skip
    admin_urls = sorted({r.admin_url for r in link.routes.values()} | (
        {link.admin_url} if link.admin_url else set()))  # fmt: skip
    return StepDecider(chooser, admin_urls, link.admin_token)


def _manager_class(
    variant: str, settings: PluginSettings, decider: StepDecider, llm_client: Any
) -> Any:
    import ray
    from verl.utils.ray_utils import auto_await

    names = (settings.project, settings.experiment)
    if variant == "fully_async":
        return fully_async_manager_class(settings, decider, llm_client)
    if variant == "legacy":
        from verl.experimental.agent_loop import AgentLoopManager, AgentLoopWorker

        worker = ray.remote(traced_worker_class(AgentLoopWorker, *names))

        @auto_await  # type: ignore[untyped-decorator]  # as verl's: awaited, or run through
        async def generate_sequences(self: Any, prompts: Any) -> Any:
            meta, rows = prompts.meta_info, prompts.non_tensor_batch
            index = rows.get("index")
            await asyncio.to_thread(decider.decide, meta.get("global_steps"),
                                    meta.get("validate", False), index)  # fmt: skip
            return await AgentLoopManager.generate_sequences(self, prompts)

        return type(
            "TracedAgentLoopManager",
            (AgentLoopManager,),
            {"agent_loop_workers_class": worker, "generate_sequences": generate_sequences},
        )
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

    worker_tq = ray.remote(traced_worker_class(AgentLoopWorkerTQ.__ray_actor_class__, *names))

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        AgentLoopManagerTQ.__init__(self, *args, **kwargs)
        self.agent_loop_workers_class = worker_tq  # verl's __init__ sets its own

    def generate_sequences_tq(self: Any, prompts: Any) -> None:
        keys = prompts.keys()
        validate = _data(prompts["validate"]) if "validate" in keys else False
        index = _data(prompts["index"]) if "index" in keys else None
        decider.decide(_data(prompts["global_steps"]) if "global_steps" in keys else None,
                       bool(validate), None if index is None else list(index))  # fmt: skip
        AgentLoopManagerTQ.generate_sequences(self, prompts)

    return type(
        "TracedAgentLoopManagerTQ",
        (AgentLoopManagerTQ,),
        {"__init__": __init__, "generate_sequences": generate_sequences_tq},
    )


def _data(value: Any) -> Any:
    """A TensorDict entry's value (NonTensorData, NonTensorStack, a tensor) as plain Python."""
    value = getattr(value, "data", value)
    return value.tolist() if hasattr(value, "tolist") else value


def fully_async_manager_class(
    settings: PluginSettings, decider: StepDecider, llm_client: Any
) -> Any:
    """verl's `FullyAsyncAgentLoopManager` with the traced worker; each sample (and each
    validation batch) goes to its worker with its step: the policy version at its start."""
    import ray
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.experimental.fully_async_policy import fully_async_rollouter
    from verl.utils.ray_utils import auto_await

    from trace_proxy.integrations.verl.standin import verl_class

    base: Any = verl_class(fully_async_rollouter.FullyAsyncAgentLoopManager)
    worker = ray.remote(traced_worker_class(AgentLoopWorker, settings.project,
                                            settings.experiment))  # fmt: skip
    versions = ServerVersions.of(llm_client)

    async def stepped(prompts: Any, validate: bool) -> Any:
        step = await versions.newest()
        if step is None:
            return prompts  # no server reports a version: verl's own step (-1)
        index = prompts.non_tensor_batch.get("index")
        await asyncio.to_thread(decider.decide, step, validate, index)
        return _with_step(prompts, step)

    async def generate_sequences_single(self: Any, prompts: Any) -> Any:
        return await base.generate_sequences_single(self, await stepped(prompts, False))

    @auto_await  # type: ignore[untyped-decorator]  # as verl's: awaited, or run through
    async def generate_sequences(self: Any, prompts: Any) -> Any:
        validate = bool(prompts.meta_info.get("validate", False))
        return await base.generate_sequences(self, await stepped(prompts, validate))

    return type(
        "TracedFullyAsyncAgentLoopManager",
        (base,),
        {
            "agent_loop_workers_class": worker,
            "generate_sequences_single": generate_sequences_single,
            "generate_sequences": generate_sequences,
        },
    )


def _read_version(server: Any) -> Any:
    return server.global_steps


class ServerVersions:
    """The policy version verl's rollout servers hold now (their `global_steps`, which verl's
    trainer sets at each weight sync): the newest of them, as a sample started now meets it."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    @classmethod
    def of(cls, llm_client: Any) -> ServerVersions:
        import ray

        balancer = llm_client._load_balancer
        try:
            table = ray.get(balancer.__ray_call__.remote(lambda b: dict(b._servers)))
        except Exception:  # a custom balancer without verl's handle table
            table = {}
        return cls(list(table.values()))

    async def newest(self) -> int | None:
        reads = [handle.__ray_call__.remote(_read_version) for handle in self.handles]
        found = await asyncio.gather(*reads, return_exceptions=True)
        versions = [int(v) for v in found if isinstance(v, int) and not isinstance(v, bool)]
        return max(versions) if versions else None


def _with_step(prompts: Any, step: int) -> Any:
    """The batch as verl's worker gets it, with `step` where verl puts a trainer's step: a
    new DataProto sharing the data (the rollouter's own batch is left as it is; the worker
    reads `global_steps` only to tag the run, and returns a batch of its own)."""
    from verl import DataProto

    meta = {**prompts.meta_info, "global_steps": step}
    return DataProto(batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch,
                     meta_info=meta)  # fmt: skip


def create(
    config: Any,
    llm_client: Any,
    teacher_client: Any = None,
    reward_loop_worker_handles: Any = None,
    *,
    fully_async: bool = False,
    **kwargs: Any,
) -> Any:
    """What `AgentLoopManager.create` does for verl's trainers; `fully_async`: called in
    place of `FullyAsyncAgentLoopManager.create` by verl's rollouter (fully_async.py)."""
    version = check_version()
    settings = read_settings(config)
    variant = "fully_async" if fully_async else _variant(settings, config, llm_client)
    limits = server_limits(config)
    link, fleet = _connect(settings, llm_client, limits)
    try:
        install(llm_client, link)
        manager_cls = _manager_class(variant, settings, _decider(settings, link), llm_client)
        manager = manager_cls.create(
            config=config,
            llm_client=llm_client,
            teacher_client=teacher_client,
            reward_loop_worker_handles=reward_loop_worker_handles,
            **kwargs,
        )
    except BaseException:
        if fleet is not None:
            fleet.stop()
        raise
    manager._trace_proxy = fleet  # each proxy drains and ends with its actor (fleet.py)
    where = link.proxy_url or f"{len(fleet.actors) if fleet else 0} node proxies"
    log.warning("trace-proxy: verl %s %s agent loop traced through %s (%d servers)", version,
                variant, where, len(link.routes) or 1)  # fmt: skip
    return manager
