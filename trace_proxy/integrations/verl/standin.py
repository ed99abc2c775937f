"""How verl's own `FullyAsyncAgentLoopManager` is found behind the plugin's stand-in for it.

Apart from both sides: the entry point's hook (`fully_async.py`) puts the stand-in under verl's
name and keeps verl's class on it; the manager (`manager.py`) builds over verl's class, never
over the stand-in. Standard library only, as the hook must be.
"""

from __future__ import annotations

VERL_CLASS = "_trace_proxy_verl_class"  # on the stand-in: verl's own class under it


def verl_class(cls: type) -> type:
    """verl's own `FullyAsyncAgentLoopManager` behind the stand-in (or `cls` itself)."""
    found: type = cls.__dict__.get(VERL_CLASS, cls)
    return found
