"""The trajectory an agent-loop task is running, for the transport to tag its requests with.

Set by the worker mixin around verl's `_run_agent_loop`; asyncio copies it into every task the
loop starts, so each generate call sees the run it belongs to.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from trace_proxy.integrations.verl.link import TrajectoryTags


@dataclass
class RunState:
    tags: TrajectoryTags
    reward: float | None = None
    generates: int = 0
    admin_urls: set[str] = field(default_factory=set)  # the proxies its calls went through
    closed: bool = False  # told to the proxies as done


CURRENT_RUN: ContextVar[RunState | None] = ContextVar("trace_proxy_verl_run", default=None)
