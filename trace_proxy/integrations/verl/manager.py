"""Builds verl's own agent-loop manager with the tracing worker and transport in place.

verl loads `trace_proxy.integrations.verl.AgentLoopManager` by its path and calls `create`
with the arguments its trainer always passes; this module checks the verl version, starts (or
finds) the proxy, registers verl's servers with it, puts the HTTP hop into verl's LLM client,
and returns verl's v1 (`AgentLoopManagerTQ`) or legacy (`AgentLoopManager`) manager, whose
workers are verl's own with the tracing mixin on top.
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
import urllib.request
from typing import Any

from trace_proxy.integrations.verl.launcher import (
    LaunchedProxy,
    ProxyStartError,
    check_running,
    launch,
)
from trace_proxy.integrations.verl.link import ProxyLink
from trace_proxy.integrations.verl.mapping import ServerLimits
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


def _variant(settings: PluginSettings, config: Any) -> str:
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


def _connect(settings: PluginSettings) -> tuple[str, str, str | None, LaunchedProxy | None]:
    if settings.url is not None:
        assert settings.admin_url is not None
        check_running(settings.url, settings.admin_url, settings.admin_token)
        return settings.url, settings.admin_url, settings.admin_token, None
    launched = launch(settings.proxy_args, settings.start_timeout)
    return launched.proxy_url, launched.admin_url, launched.admin_token, launched


def _register_all(link: ProxyLink, llm_client: Any) -> list[str]:
    """verl's servers, registered before any rollout (a server added later is registered by
    the worker that first gets it from verl's load balancer)."""
    import ray

    balancer = getattr(llm_client, "_load_balancer", None)
    if balancer is None:
        return []
    servers: list[str] = list(ray.get(balancer.get_all_servers.remote()))
    for server_id in servers:
        request = urllib.request.Request(
            f"{link.admin_url}/upstreams/{server_id}",
            data=json.dumps({"url": f"http://{server_id}"}).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {link.admin_token}",
            },
            method="PUT",
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            raise ProxyStartError(
                f"trace-proxy refused to register verl's server {server_id}: "
                f"{exc.code} {exc.read()[:500]!r}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ProxyStartError(f"trace-proxy at {link.admin_url}: {exc}") from None
    return servers


def _manager_class(variant: str, settings: PluginSettings) -> Any:
    import ray

    names = (settings.project, settings.experiment)
    if variant == "legacy":
        from verl.experimental.agent_loop import AgentLoopManager, AgentLoopWorker

        worker = ray.remote(traced_worker_class(AgentLoopWorker, *names))
        return type(
            "TracedAgentLoopManager", (AgentLoopManager,), {"agent_loop_workers_class": worker}
        )
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

    worker_tq = ray.remote(traced_worker_class(AgentLoopWorkerTQ.__ray_actor_class__, *names))

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        AgentLoopManagerTQ.__init__(self, *args, **kwargs)
        self.agent_loop_workers_class = worker_tq  # verl's __init__ sets its own

    return type("TracedAgentLoopManagerTQ", (AgentLoopManagerTQ,), {"__init__": __init__})


def create(
    config: Any,
    llm_client: Any,
    teacher_client: Any = None,
    reward_loop_worker_handles: Any = None,
    **kwargs: Any,
) -> Any:
    """What `AgentLoopManager.create` does for verl's trainers."""
    version = check_version()
    settings = read_settings(config)
    variant = _variant(settings, config)
    limits = server_limits(config)
    proxy_url, admin_url, token, launched = _connect(settings)
    try:
        link = ProxyLink(proxy_url, admin_url, token, limits)
        servers = _register_all(link, llm_client)
        install(llm_client, link)
        manager_cls = _manager_class(variant, settings)
        manager = manager_cls.create(
            config=config,
            llm_client=llm_client,
            teacher_client=teacher_client,
            reward_loop_worker_handles=reward_loop_worker_handles,
            **kwargs,
        )
    except BaseException:
        if launched is not None:
            launched.stop()
        raise
    manager._trace_proxy = launched  # stopped with the process (atexit), drained first
    log.warning(
        "trace-proxy: verl %s %s agent loop traced through %s (%d servers registered)",
        version,
        variant,
        proxy_url,
        len(servers),
    )
    return manager
