"""What verl's agent-loop worker adds: the trajectory's tags around each agent-loop run, its
end (and reward) told to the proxy, and verl's in-process trace switched off.

`_run_agent_loop` is where verl knows a run's step (`global_steps`), sample index, rollout
index (v1: `session_id`, as its `trajectory["rollout_n"]` is always 0) and validate flag.
`_compute_score` runs once the agent loop has returned, with the reward verl computed, and
before the sample is handed over: v1's worker puts it into the TransferQueue right after
(`_agent_loop_postprocess`), where the trainer may take it, end the step and the job, before
`_run_agent_loop` returns. So the trajectory is closed (`done`, with the reward) there, and the
proxy has it before the trainer does; `_run_agent_loop` closes it on its way out only when that
never ran (an agent loop that raised or was cancelled).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from trace_proxy.integrations.verl.context import CURRENT_RUN, RunState
from trace_proxy.integrations.verl.link import ProxyLink, TrajectoryTags
from trace_proxy.integrations.verl.transport import LINK_ATTRIBUTE


def without_verl_trace(config: Any) -> Any:
    """A copy of verl's config whose rollout trace backend is off: the proxy records instead,
    so verl's own tracer (weave, mlflow, trackio) does not run a second time."""
    from omegaconf import OmegaConf, open_dict

    trace = OmegaConf.select(config, "actor_rollout_ref.rollout.trace")
    if trace is None or not trace.get("backend"):
        return config
    copied = copy.deepcopy(config)  # the trainer's own config is left as it is
    with open_dict(copied):
        copied.actor_rollout_ref.rollout.trace.backend = None
    return copied


class TracedWorkerMixin:
    """Put before verl's AgentLoopWorker (or AgentLoopWorkerTQ's class) in the bases."""

    _trace_proxy_project: str
    _trace_proxy_experiment: str

    def __init__(self, config: Any, llm_client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(without_verl_trace(config), llm_client, *args, **kwargs)  # type: ignore[call-arg]

    @property
    def _trace_proxy(self) -> ProxyLink:
        link: ProxyLink = getattr(self.llm_client, LINK_ATTRIBUTE)  # type: ignore[attr-defined]
        return link

    async def _run_agent_loop(
        self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any
    ) -> Any:
        rollout_n = kwargs.get("session_id", trajectory["rollout_n"])
        tags = TrajectoryTags(
            project=self._trace_proxy_project,
            experiment=self._trace_proxy_experiment,
            step=int(trajectory["step"]),
            sample_index=int(trajectory["sample_index"]),
            rollout_n=int(rollout_n),
            validate=bool(trajectory["validate"]),
            trajectory_id=uuid.uuid4().hex,
            sample_id=None if kwargs.get("uid") is None else str(kwargs["uid"]),
        )
        run = RunState(tags)
        token = CURRENT_RUN.set(run)
        try:
            kwargs["trace"] = False  # verl's own rollout trace: the proxy records this run
            return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)  # type: ignore[misc]
        finally:
            CURRENT_RUN.reset(token)
            await self._close(run)

    async def _compute_score(self, outputs: list[Any], kwargs: dict[str, Any]) -> None:
        await super()._compute_score(outputs, kwargs=kwargs)  # type: ignore[misc]
        run = CURRENT_RUN.get()
        if run is not None:
            score = outputs[-1].reward_score if outputs else None
            run.reward = None if score is None else float(score)
            await self._close(run)

    async def _close(self, run: RunState) -> None:
        """Done, with verl's reward, on every proxy the run's calls went through; once."""
        if run.generates and not run.closed:
            run.closed = True
            await self._trace_proxy.end_trajectory(run.tags, run.reward, run.admin_urls)


def traced_worker_class(base: type, project: str, experiment: str) -> type:
    """A worker class verl can start as a Ray actor: the mixin over `base`, with the names
    every record of this run carries."""
    return type(
        "Traced" + base.__name__,
        (TracedWorkerMixin, base),
        {"_trace_proxy_project": project, "_trace_proxy_experiment": experiment},
    )
