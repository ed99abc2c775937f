"""The plugin's settings read from verl's config as verl composes it (`compose_config`, the
harness's overrides: the tool agent loop, a local model directory, vLLM), with each case's
further command-line overrides; `read_settings` reads verl's own defaults from the verl here.

    python -m verl_harness.resolve_settings MODEL_DIR WORK_DIR CASES_JSON

CASES_JSON maps a case's name to its overrides; prints, for each, the proxy options and the
`trace.token2text` verl's config holds, as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verl_harness.run import compose_config

from trace_proxy.integrations.verl.settings import read_settings


def main() -> int:
    model_dir, work, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    resolved = {}
    for name, overrides in cases.items():
        config = compose_config(model_dir, work, plugin=True, extra=overrides)
        resolved[name] = {
            "proxy_args": read_settings(config).proxy_args,
            "verl_token2text": config.actor_rollout_ref.rollout.trace.token2text,
        }
    print(json.dumps(resolved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
