"""One test of each kind, run by a pytest of its own in an environment a user's machine may
well have: a Ray cluster's address, an MLflow server, a collector and its settings, W&B, a Hugging
Face hub, an HTTP proxy that loopback is not exempt from, and trace-proxy's own options. Each
kind passes all the same: the suite never reads the machine's settings (support/isolation.py)
and never joins a service it did not start.

Its session (hostile.py) is handed the session's vLLM server rather than starting another: it
starts once verl's runs, which compare what that server gives with no other traffic, have exited,
beside the tests still running, and this test, last (verl_run.py), waits for it. verl's kind is
its config composed and resolved in verl's venv, not a whole verl run again: every verl run of
every session already starts its Ray away from the machine's (verl_run.py).
"""

from __future__ import annotations

from pathlib import Path

from .hostile import HOSTILE_RUN, ONE_OF_EACH_KIND
from .servers import RealServers


def test_one_test_of_each_kind_passes_in_a_hostile_environment(
    tmp_path: Path, _real_servers: RealServers
) -> None:
    if not HOSTILE_RUN.started:
        HOSTILE_RUN.start(_real_servers, tmp_path)
    code, output = HOSTILE_RUN.wait()
    summary = output[output.rfind("short test summary") :]
    assert code == 0, output[-10000:]
    for test in ONE_OF_EACH_KIND:
        assert f"PASSED {test}" in summary, summary
    # its vLLM tests used the session's server, not one it started
    assert f"healthy at {HOSTILE_RUN.vllm_url} (first needed handed over)" in output
