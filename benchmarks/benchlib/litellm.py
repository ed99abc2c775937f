"""LiteLLM's proxy as a peer: installed once into a cached virtualenv, run with logging off.

LiteLLM is a large dependency tree (about 750 MB) that trace-proxy must not depend on, so it
lives in its own venv (`$TRACE_PROXY_BENCH_CACHE/litellm`, default
`~/.cache/trace-proxy-bench/litellm`; `--litellm PATH` points at an existing `litellm`
executable instead). It is configured with the benchmark upstream as an OpenAI-compatible
backend (`openai/<model>`, `api_base` = upstream) under the model name the workload sends, one
uvicorn worker, no access log, no telemetry, no cost-map download retried on the hot path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib.procs import BenchError, Proc, free_port, spawn, wait_for_port
from benchlib.workload import MODEL

PACKAGE = "litellm[proxy]"


def cache_dir() -> Path:
    root = os.environ.get("TRACE_PROXY_BENCH_CACHE") or Path.home() / ".cache/trace-proxy-bench"
    return Path(root) / "litellm"


def ensure_litellm(explicit: str | None = None) -> Path:
    """The `litellm` executable: given, cached, or installed now (a few minutes, once)."""
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise BenchError(f"--litellm {explicit}: no such file")
        return path
    venv = cache_dir()
    binary = venv / "bin" / "litellm"
    if binary.exists():
        return binary
    print(f"installing {PACKAGE} into {venv} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", PACKAGE], capture_output=True, text=True
    )
    if done.returncode != 0 or not binary.exists():
        shutil.rmtree(venv, ignore_errors=True)
        raise BenchError(f"could not install {PACKAGE}:\n{done.stderr[-2000:]}")
    return binary


def version(binary: Path) -> str:
    pip = binary.parent / "pip"
    done = subprocess.run([str(pip), "show", "litellm"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def start_litellm(
    workdir: Path, upstream: str, binary: Path, cpus: frozenset[int] | None = None
) -> tuple[Proc, str]:
    home = workdir / "litellm"
    home.mkdir()
    config = home / "config.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: false\n"
        "  turn_off_message_logging: true\n"
    )
    logging_config = home / "logging.json"
    logging_config.write_text(json.dumps({
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: {"level": "WARNING"} for name in
                    ("uvicorn", "uvicorn.access", "uvicorn.error", "LiteLLM", "LiteLLM Proxy")},
    }))  # fmt: skip
    port = free_port()
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1", "--log_config", str(logging_config)]  # fmt: skip
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download attempts
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    # A local benchmark on loopback: no master key.
    os.environ.setdefault("LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY", "true")
    proc = spawn("litellm", argv, workdir, cpus=cpus)
    wait_for_port(proc, port, timeout=180)
    return proc, f"http://127.0.0.1:{port}"
