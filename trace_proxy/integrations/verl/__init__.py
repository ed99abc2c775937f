"""Tracing verl's agent loop (rollout mode=async) by configuration alone.

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trace_proxy.integrations.verl.AgentLoopManager

verl loads the class by its path and calls `create(config=..., llm_client=..., ...)`, as for
its own manager; the manager it gets back is verl's own (v1 or legacy, chosen from its config)
with every generate going through trace-proxy. verl is imported only when `create` runs.
"""

from __future__ import annotations

from typing import Any


class AgentLoopManager:
    """Stands for verl's manager class in its config; `create` returns verl's own manager."""

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        from trace_proxy.integrations.verl.manager import create

        return create(*args, **kwargs)


__all__ = ["AgentLoopManager"]
