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

Calls arriving together share a read (`GateReads`): a call joins the next read to start after it
arrived, never one already under way, so what it gets is as fresh as a read of its own, while a
worker with hundreds of calls in flight asks each server once per round trip, not once per call.
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


class GateReads:
    """One worker's reads of its servers' gates, shared by the calls that arrive while a read
    is under way: they wait for the one that starts after it."""

    def __init__(self) -> None:
        self._next: dict[Any, asyncio.Future[tuple[bool, bool, Any]]] = {}
        self._reading: dict[Any, asyncio.Task[None]] = {}

    async def read(self, key: Any, server: Any) -> tuple[bool, bool, Any]:
        waiting = self._next.get(key)
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            waiting.add_done_callback(_retrieved)
            self._next[key] = waiting
            if key not in self._reading:
                self._reading[key] = asyncio.create_task(self._read_while_asked(key, server))
        return await asyncio.shield(waiting)

    async def _read_while_asked(self, key: Any, server: Any) -> None:
        try:
            while (asked := self._next.pop(key, None)) is not None:
                try:
                    asked.set_result(await server.__ray_call__.remote(read_gate))
                except asyncio.CancelledError:
                    asked.cancel()
                    raise
                except BaseException as exc:  # every caller gets what the read raised
                    asked.set_exception(exc)
        finally:
            del self._reading[key]
            left = self._next.pop(key, None)
            if left is not None:
                left.cancel()


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks a failed read seen even when every caller waiting for it was cancelled."""
    if not future.cancelled():
        future.exception()


async def admit(server: Any, reads: GateReads | None = None, key: Any = None) -> Admission:
    """The version of the weights this call is admitted to, as verl's server would give it;
    waits while the server's gate is closed (a weight sync), as verl's `generate` waits.
    With `reads`, the read is shared with the calls to the same server (`key`) arriving with it."""
    delay = GATE_POLL_FIRST_S
    while True:
        if reads is None:
            closed, rejecting, version = await server.__ray_call__.remote(read_gate)
        else:
            closed, rejecting, version = await reads.read(key, server)
        if not closed or rejecting:
            return Admission(version, rejecting)
        await asyncio.sleep(delay)
        delay = min(delay * 2, GATE_POLL_MAX_S)
