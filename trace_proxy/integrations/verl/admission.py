"""A call's policy version, read from verl's server actor as the call is admitted.

verl 0.9.x's server returns its `global_steps` with every generate, read when the generate
ends. Its asynchronous trainers change that value only behind the server's submission gate
(`checkpoint_engine/base.py` `update_weights`: abort every request in flight and close the
gate, send the weights, `set_global_steps`, then resume and open the gate), and a generate
waits at that gate while it is closed (`vllm_async_server.py` `_park_until_admitted`). So the
version a generate returns is the one in force while the gate was last open before it was
admitted: a call that runs to its end does so on it, a call aborted by the next sync returns
it, and a call that waited at the closed gate gets the version the sync set.

The HTTP hop goes past that gate (it is a Ray-side check in verl's server actor, not in
vLLM). So the plugin does what verl's `generate` does first: it reads the gate and the
version in the server actor in one step, waits while the gate is closed, and answers as verl's
server does when the gate rejects late arrivals (a hybrid replica handed back to training).
The version read with the gate open is the call's. One window is left: a sync that begins
between that read and vLLM receiving the request (the HTTP hop, milliseconds) is not seen;
verl's own path closes it with an admission counter in its server actor that a client cannot
join. Servers without a gate (another verl build) are read as always open.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

GATE_POLL_FIRST_S = 0.02  # while the gate is closed, read it again after this, doubling
GATE_POLL_MAX_S = 0.5


@dataclass(frozen=True)
class Admission:
    """`version`: the server's `global_steps` with the gate open; `rejected`: the gate turns
    late arrivals away, and verl's server would answer this call `aborted` at once."""

    version: Any
    rejected: bool = False


def read_gate(server: Any) -> tuple[bool, bool, Any]:
    """Run in the server actor: (gate closed, rejecting late arrivals, `global_steps`), read
    together on its event loop so no sync can fall between them."""
    closed = bool(getattr(server, "_submission_paused", False))
    rejecting = closed and bool(getattr(server, "_rejecting", False))
    return closed, rejecting, server.global_steps


async def admit(server: Any) -> Admission:
    """The version of the weights this call is admitted to, as verl's server would give it;
    waits while the server's gate is closed (a weight sync), as verl's `generate` waits."""
    delay = GATE_POLL_FIRST_S
    while True:
        closed, rejecting, version = await server.__ray_call__.remote(read_gate)
        if not closed or rejecting:
            return Admission(version, rejecting)
        await asyncio.sleep(delay)
        delay = min(delay * 2, GATE_POLL_MAX_S)
