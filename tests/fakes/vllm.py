"""The vLLM fake for tests: the project's simulated vLLM server, re-exported.

The simulator lives in the package (`trace_proxy.demo.simulated_vllm`) because `trace-proxy
demo` and the benchmarks use it too; tests import it from here so every fake sits in one place.
"""

from trace_proxy.demo.simulated_vllm import (
    FIXED_CREATED,
    RecordedRequest,
    SimulatedVLLM,
    start_app,
)

FakeVLLM = SimulatedVLLM

__all__ = ["FIXED_CREATED", "FakeVLLM", "RecordedRequest", "SimulatedVLLM", "start_app"]
