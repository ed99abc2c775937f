"""The hostile environment's session (test_hostile_environment.py): one test of each kind, run by
a pytest of its own with a user's machine's settings pointing elsewhere, in the background.

Its session is handed the session's vLLM server (servers.py) rather than starting another, so it
starts once no other test or run will use that server: after verl's runs have exited (their
comparisons never share the server), beside the tests still running (the root conftest), or in
its test when nothing started it. Everything that session starts and does is in the hostile
environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from .servers import REAL_TESTS_DIR, RealServers, stop_group

HOSTILE_TESTS = REAL_TESTS_DIR / "test_hostile_environment.py"
STOP_GRACE_S = 10.0
TESTS = REAL_TESTS_DIR.parent
UNREACHABLE = "http://127.0.0.1:9"
ONE_OF_EACH_KIND = [
    # the proxy
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


def is_hostile_test(item: pytest.Item) -> bool:
    return item.path.resolve() == HOSTILE_TESTS


class HostileRun:
    """The hostile environment's pytest session: started once, waited on by its test, stopped
    at the session's end if still running."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self._work: Path | None = None
        self._failed: str | None = None  # why it could not be started
        self.vllm_url: str | None = None  # the server it was handed

    @property
    def started(self) -> bool:
        return self._process is not None or self._failed is not None

    def could_not_start(self, why: str) -> None:
        self._failed = why

    def start(self, servers: RealServers, work: Path) -> None:
        """Its own process group, so that stopping it reaches everything it started."""
        handed_over = servers.handed_over_env("real_vllm")
        self.vllm_url = servers.wait_healthy("real_vllm").base_url
        env = {**os.environ, **HOSTILE, **handed_over}
        env.pop("TRACE_PROXY_GOLDEN", None)  # compare, never write
        command = [sys.executable, "-m", "pytest", *ONE_OF_EACH_KIND, "-rA", "-p",
                   "no:cacheprovider", "--basetemp", str(work / "session")]  # fmt: skip
        self._work = work
        self._out = (work / "stdout").open("wb")
        self._process = subprocess.Popen(
            command, cwd=TESTS.parent, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait(self) -> tuple[int, str]:
        """Its exit code and output (stdout and stderr), once it has exited."""
        if self._failed is not None:
            pytest.fail(f"the hostile session could not be started: {self._failed}", pytrace=False)
        assert self._process is not None and self._work is not None
        code = self._process.wait()
        self._close()
        return code, (self._work / "stdout").read_text(errors="replace")

    def stop(self) -> None:
        """At the session's end: the session and every process it started, if still running."""
        process = self._process
        if process is not None:
            stop_group(process, STOP_GRACE_S)
        self._close()

    def _close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


HOSTILE_RUN = HostileRun()
