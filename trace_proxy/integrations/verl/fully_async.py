"""verl's fully asynchronous trainer traced by the override its other trainers take.

`experimental/fully_async_policy`'s rollouter builds its agent-loop manager in code: it looks
`FullyAsyncAgentLoopManager` up in its module when it calls `.create(...)`, and never reads
`actor_rollout_ref.rollout.agent.agent_loop_manager_class`. verl imports every `verl.plugins`
entry point on `import verl`; trace-proxy's is this module, and all it does then is register
an import hook (standard library only: it can neither slow nor break `import verl`). When
verl's rollouter module is loaded, the hook puts a subclass of verl's class under that name
whose `create` reads the config it is given: if the config names the plugin, the manager is
the plugin's, built over verl's class (manager.py); otherwise it is verl's own `create`, and
the manager verl's, untouched. Nothing else of verl changes, and nothing at all in a process
that never imports the rollouter.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from trace_proxy.integrations.verl.standin import VERL_CLASS

log = logging.getLogger(__name__)
ROLLOUTER_MODULE = "verl.experimental.fully_async_policy.fully_async_rollouter"
MANAGER_NAME = "FullyAsyncAgentLoopManager"
PLUGIN_CLASS = "trace_proxy.integrations.verl.AgentLoopManager"


def names_plugin(config: Any) -> bool:
    """The user's config sets `agent_loop_manager_class` to the plugin's class."""
    try:
        agent = config.actor_rollout_ref.rollout.get("agent") or {}
        return str(agent.get("agent_loop_manager_class") or "") == PLUGIN_CLASS
    except Exception:  # not verl's config: not ours to trace
        return False


def wrap(module: ModuleType) -> None:
    """Put the stand-in under verl's manager name in the rollouter's module (once)."""
    original = getattr(module, MANAGER_NAME, None)
    if isinstance(original, type) and VERL_CLASS in original.__dict__:
        return  # already the stand-in
    if not isinstance(original, type) or not hasattr(original, "create"):
        log.warning("trace-proxy: verl's fully async rollouter has no %s class; a run whose "
                    "config names %s is not traced", MANAGER_NAME, PLUGIN_CLASS)  # fmt: skip
        return
    from verl.utils.ray_utils import auto_await

    async def create(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is not stand_in:  # a subclass someone made of the name: verl's create
            return await super(stand_in, cls).create(*args, **kwargs)  # type: ignore[misc,arg-type]
        config = kwargs.get("config", args[0] if args else None)
        if not names_plugin(config):
            return await original.create(*args, **kwargs)
        return await build(args, kwargs)

    stand_in = type(
        MANAGER_NAME,
        (original,),
        {
            "create": classmethod(auto_await(create)),  # awaited or called, as verl's
            VERL_CLASS: original,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__doc__": original.__doc__,
        },
    )
    setattr(module, MANAGER_NAME, stand_in)


async def build(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The plugin's manager over verl's class (manager.py finds it again). Its start
    (proxies, Ray calls that wait) runs in a thread: the rollouter's event loop runs on."""
    import asyncio

    from trace_proxy.integrations.verl.manager import create

    return await asyncio.to_thread(create, *args, fully_async=True, **kwargs)


class _WrappingLoader(importlib.abc.Loader):
    """verl's own loader for the rollouter module, then `wrap` on the module it made."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            wrap(module)
        except Exception as exc:  # tracing never stops verl from importing its trainer
            log.warning("trace-proxy: fully async rollouter not traced (%r)", exc)


class _RollouterFinder(importlib.abc.MetaPathFinder):
    """Finds verl's rollouter module as the other finders do, with `_WrappingLoader` on top."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ROLLOUTER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register the hook (once); the rollouter module, if already loaded, is wrapped now."""
    if any(isinstance(finder, _RollouterFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _RollouterFinder())
    loaded = sys.modules.get(ROLLOUTER_MODULE)
    if loaded is not None:
        try:
            wrap(loaded)
        except Exception as exc:
            log.warning("trace-proxy: fully async rollouter not traced (%r)", exc)


try:  # run by verl's `verl.plugins` entry point (or VERL_USE_EXTERNAL_MODULES) on import
    install()
except Exception as exc:  # never break `import verl`
    log.warning("trace-proxy: fully async rollouter hook not installed (%r)", exc)
