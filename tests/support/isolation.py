"""The test session's environment, cleared of the settings a user's shell may hold for the tools
the tests run, before anything reads them: the root conftest imports this module first.

A machine that runs the tests is usually one that runs the real thing too: a Ray cluster
(`RAY_ADDRESS`), an MLflow server (`MLFLOW_TRACKING_URI`), a collector (`OTEL_*`), W&B
(`WANDB_*`, `WEAVE_*`), a Hugging Face cache or hub (`HF_*`), trace-proxy's own options
(`TRACE_PROXY_*`, read by `config.py`). Each would change what a test sends, where it sends it
or what it compares, so each is removed, and child processes (servers, verl's run, the
frameworks' clients) inherit the cleared environment. The suite's own switches are kept.

An HTTP proxy is kept, for provisioning's downloads, but every loopback address the tests
serve on is added to `no_proxy`, so that no test's request goes through it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CLEARED_PREFIXES = (
    "TRACE_PROXY_", "RAY_", "OTEL_", "MLFLOW_", "WANDB_", "WEAVE_", "TRACKIO_", "HF_",
    "HUGGINGFACE_", "TRANSFORMERS_", "VLLM_", "SGLANG_", "OPENAI_",
)  # fmt: skip
SUITE_SWITCHES = frozenset({
    "TRACE_PROXY_GOLDEN", "TRACE_PROXY_TEST_CACHE", "TRACE_PROXY_TORCH_INDEX_URL",
    "TRACE_PROXY_SKIP_REAL", "TRACE_PROXY_SKIP_CONTAINER", "TRACE_PROXY_REAL_STARTUP_TIMEOUT",
    "TRACE_PROXY_REQUIRE_BROWSER", "TRACE_PROXY_TEST_ARTIFACTS", "TRACE_PROXY_BENCH_CACHE",
    "TRACE_PROXY_TEST_ONE_LANE",  # support/lane.py
    "TRACE_PROXY_TEST_HANDED_OVER",  # taken only from this session's parent (real/servers.py)
})  # fmt: skip
# The verl cluster's nodes listen on 127.0.0.1-3 (tests/real/verl_harness/cluster.py).
LOOPBACK = ("localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3", "::1")


def isolate(environ: MutableMapping[str, str]) -> list[str]:
    """Clear the machine's settings from `environ`; the names cleared."""
    cleared = sorted(
        name
        for name in environ
        if name.upper().startswith(CLEARED_PREFIXES) and name not in SUITE_SWITCHES
    )
    for name in cleared:
        del environ[name]
    bypassed = [
        entry.strip()
        for name in ("no_proxy", "NO_PROXY")
        for entry in environ.get(name, "").split(",")
        if entry.strip()
    ]
    environ["no_proxy"] = environ["NO_PROXY"] = ",".join(dict.fromkeys([*bypassed, *LOOPBACK]))
    return cleared


CLEARED = isolate(os.environ)
