"""Tracing verl's agent loop (rollout mode=async) by configuration alone.

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trace_proxy.integrations.verl.AgentLoopManager

verl loads the class by its path and calls `create(config=..., llm_client=..., ...)`, as for
its own manager; the manager it gets back is verl's own (v1 or legacy, chosen from its config)
with every generate going through trace-proxy. verl is imported only when `create` runs.
verl's fully asynchronous rollouter ignores the key; the same override traces it through
`fully_async.py`, which verl loads as a `verl.plugins` entry point.
"""

from __future__ import annotations

import sys
from typing import Any

CO_COROUTINE = 0x80  # inspect.CO_COROUTINE, without importing inspect here


class AgentLoopManager:
    """Stands for verl's manager class in its config; `create` returns verl's own manager."""

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        """As verl's `create` (`auto_await`): awaitable when a coroutine calls it (as verl's
        fully async rollouter calls its manager's), else the manager itself."""
        from trace_proxy.integrations.verl.manager import create

        if _called_from_coroutine():
            import asyncio

            return asyncio.to_thread(create, *args, **kwargs)
        return create(*args, **kwargs)


def _called_from_coroutine() -> bool:
    """`create`'s caller is a coroutine running on this thread's event loop."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return bool(sys._getframe(2).f_code.co_flags & CO_COROUTINE)


__all__ = ["AgentLoopManager"]
