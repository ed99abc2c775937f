"""One test of each kind, run by a pytest of its own in an environment a user's machine may
well have: a Ray cluster's address, an MLflow server, a collector and its settings, W&B, a Hugging
Face hub, an HTTP proxy that loopback is not exempt from, and trace-proxy's own options. Each
kind passes all the same: the suite never reads the machine's settings (support/isolation.py)
and never joins a service it did not start.

It runs last (verl_run.py), after the session's own verl runs, and stops the session's real
servers first: its own session starts its own, and a machine may not hold two of each. verl's
kind is its config composed and resolved in verl's venv, not a whole verl run again: every verl
run of every session already starts its Ray away from the machine's (verl_run.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .servers import REAL_TESTS_DIR, RealServers

TESTS = REAL_TESTS_DIR.parent
UNREACHABLE = "http://127.0.0.1:9"
ONE_OF_EACH_KIND = [
    "tests/processes/test_lifecycle.py::test_sigterm_drains_in_flight_streams_then_flushes",
    "tests/test_golden.py::test_each_backend_renders_them_as_before",
    "tests/exporters/test_otlp.py::test_the_same_spans_arrive_over_otlp_http_with_the_configured_headers",
    "tests/exporters/test_mlflow.py::test_http_path_exports_recorded_trajectories_over_otlp",
    "tests/exporters/test_trackio.py::test_chat_tool_rollout_is_one_trace_with_the_whole_conversation",
    "tests/exporters/test_weave.py::test_chat_tool_rollout_is_one_call_tree",
    "tests/real/test_real_through_proxy.py::test_vllm_passthrough_and_record[chat-plain]",
    "tests/real/test_framework_clients.py::test_a_framework_client_through_the_proxy[openai]",
    "tests/real/test_verl_settings.py::test_verls_composed_config_decodes_unless_the_user_said_no",
]  # fmt: skip
HOSTILE = {
    "RAY_ADDRESS": "127.0.0.1:1",
    "HF_HUB_OFFLINE": "0",
    "TRANSFORMERS_OFFLINE": "0",
    "HF_ENDPOINT": UNREACHABLE,
    "HF_HOME": "/proc/hostile-hf-home",
    "MLFLOW_TRACKING_URI": UNREACHABLE,
    "MLFLOW_EXPERIMENT_NAME": "hostile",
    "MLFLOW_RUN_ID": "0123456789abcdef0123456789abcdef",
    "OTEL_SDK_DISABLED": "true",
    "OTEL_SERVICE_NAME": "hostile",
    "OTEL_RESOURCE_ATTRIBUTES": "host.name=hostile,deployment.environment=hostile",
    "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "host,process,os",
    "OTEL_TRACES_SAMPLER": "always_off",
    "OTEL_EXPORTER_OTLP_ENDPOINT": UNREACHABLE,
    "OTEL_EXPORTER_OTLP_HEADERS": "authorization=hostile",
    "WANDB_API_KEY": "hostile" * 6,
    "WANDB_BASE_URL": UNREACHABLE,
    "WANDB_ENTITY": "hostile",
    "WANDB_PROJECT": "hostile",
    "WANDB_MODE": "disabled",
    "WEAVE_DISABLED": "true",
    "WEAVE_PRINT_CALL_LINK": "true",
    "TRACKIO_DIR": "/proc/hostile-trackio",
    "http_proxy": UNREACHABLE,
    "https_proxy": UNREACHABLE,
    "all_proxy": UNREACHABLE,
    "HTTP_PROXY": UNREACHABLE,
    "HTTPS_PROXY": UNREACHABLE,
    "ALL_PROXY": UNREACHABLE,
    "no_proxy": "example.invalid",
    "NO_PROXY": "example.invalid",
    "TRACE_PROXY_CONFIG": "/proc/hostile-trace-proxy.yaml",
    "TRACE_PROXY_BACKEND": "otlp",
    "TRACE_PROXY_OTLP_ENDPOINT": UNREACHABLE,
    "TRACE_PROXY_TOKEN2TEXT": "false",
    "TRACE_PROXY_SAMPLE_RATE": "0.5",
    "TRACE_PROXY_PROJECT": "hostile",
    "TRACE_PROXY_ADMIN_TOKEN": "hostile",
    "TRACE_PROXY_CACHE": "/proc/hostile-cache",
}


def test_one_test_of_each_kind_passes_in_a_hostile_environment(
    tmp_path: Path, _real_servers: RealServers
) -> None:
    _real_servers.stop_all()
    env = {**os.environ, **HOSTILE}
    env.pop("TRACE_PROXY_GOLDEN", None)  # compare, never write
    command = [sys.executable, "-m", "pytest", *ONE_OF_EACH_KIND, "-rA", "-p", "no:cacheprovider",
               "--basetemp", str(tmp_path / "session")]  # fmt: skip
    ran = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True)
    summary = ran.stdout[ran.stdout.rfind("short test summary") :]
    assert ran.returncode == 0, ran.stdout[-8000:] + ran.stderr[-2000:]
    for test in ONE_OF_EACH_KIND:
        assert f"PASSED {test}" in summary, summary
