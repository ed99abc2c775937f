"""What the verl plugin makes of verl's own config: composed by hydra from verl 0.9.1's
`ppo_trainer.yaml` with command-line overrides as verl's `main_ppo` composes it (in verl's
venv, `verl_harness/resolve_settings.py`), not a hand-built mapping.

verl ships `actor_rollout_ref.rollout.trace.token2text: false`, and the config verl hands the
manager keeps no record of who set a value; so only the user's `trace_proxy.token2text`, or a
verl value other than verl's default, decides whether calls are decoded (and tool calls become
tool spans). Left alone, a local model directory means decoded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .provision import Provisioned, provision
from .servers import REAL_TESTS_DIR
from .verl_run import REPO

VERL_ON = "actor_rollout_ref.rollout.trace.token2text=true"
VERL_OFF = "actor_rollout_ref.rollout.trace.token2text=false"
OURS_OFF = "+trace_proxy.token2text=false"
CASES = {
    "documented overrides only": [],
    "verl's token2text on": [VERL_ON],
    "verl's token2text at its default": [VERL_OFF],
    "ours off": [OURS_OFF],
    "ours off, verl's on": [VERL_ON, OURS_OFF],
}


@pytest.fixture(scope="module")
def provisioned() -> Provisioned:
    return provision()


def _resolve(provisioned: Provisioned, work: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REAL_TESTS_DIR}",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    done = subprocess.run(
        [str(provisioned.verl_python), "-m", "verl_harness.resolve_settings",
         str(provisioned.model_dir), str(work), json.dumps(CASES)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    resolved: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return resolved


def _decoding(proxy_args: list[str]) -> tuple[bool, str | None]:
    tokenizer = (
        proxy_args[proxy_args.index("--tokenizer") + 1] if "--tokenizer" in proxy_args else None
    )
    return "--token2text" in proxy_args, tokenizer


def test_verls_composed_config_decodes_unless_the_user_said_no(
    provisioned: Provisioned, tmp_path: Path
) -> None:
    resolved = _resolve(provisioned, tmp_path)
    model_dir = str(provisioned.model_dir)
    # verl's own default, as its composed config gives it to the manager
    assert resolved["documented overrides only"]["verl_token2text"] is False
    decoded = (True, model_dir)
    assert _decoding(resolved["documented overrides only"]["proxy_args"]) == decoded
    assert _decoding(resolved["verl's token2text on"]["proxy_args"]) == decoded
    # verl's false is what verl ships: it cannot be told from a user's, so it says nothing
    assert _decoding(resolved["verl's token2text at its default"]["proxy_args"]) == decoded
    assert _decoding(resolved["ours off"]["proxy_args"]) == (False, None)
    assert _decoding(resolved["ours off, verl's on"]["proxy_args"]) == (False, None)
