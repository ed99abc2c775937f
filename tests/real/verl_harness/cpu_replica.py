"""verl's vLLM rollout replica, for the fully async rollouter on CPU: one stand-in server actor.

verl's `vLLMReplica` starts its server actor on GPUs; the fully async rollouter builds its
replicas itself (`FullyAsyncLLMServerManager`, from `RolloutReplicaRegistry`'s "vllm" entry).
Loaded in every process through verl's own `VERL_USE_EXTERNAL_MODULES`, this module registers
a replica that starts the stand-in server actor of server.py in front of the real vLLM CPU
server instead, with the attributes verl's server manager and load balancer read
(`_server_handle`, `_server_address`, `replica_rank`, `workers`). Everything else is verl's.
"""

from __future__ import annotations

import os
from typing import Any

VLLM_URL_VARIABLE = "TRACE_PROXY_TEST_VLLM_URL"


class CpuReplica:
    def __init__(self, replica_rank: int, config: Any, model_config: Any,
                 gpus_per_node: int = 1, **kwargs: Any) -> None:  # fmt: skip
        self.replica_rank = replica_rank
        self.config = config
        self.workers: list[Any] = []
        self._server_handle: Any = None
        self._server_address: str | None = None

    async def init_standalone(self) -> None:
        from omegaconf import OmegaConf
        from verl_harness.server import CpuVllmServer

        url = os.environ[VLLM_URL_VARIABLE]
        rollout = OmegaConf.to_container(self.config, resolve=True)
        self._server_handle = CpuVllmServer.remote(url, rollout)
        self._server_address = url.removeprefix("http://")

    async def start_profile(self, **kwargs: Any) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


def _register() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", lambda: CpuReplica)  # type: ignore[arg-type,return-value]


_register()
