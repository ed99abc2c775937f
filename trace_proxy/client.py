"""Posting rewards to a running proxy from training code, with the standard library only.

from trace_proxy.client import post_reward
post_reward("http://127.0.0.1:8101", reward=1.0, experiment="grpo", step=3,
            sample_index=17, rollout_n=2, labels={"correct": True})
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class RewardRejected(RuntimeError):
    """The proxy refused the reward; the message is its explanation."""


def post_reward(
    admin_url: str,
    *,
    reward: float | None = None,
    score: float | None = None,
    labels: dict[str, Any] | None = None,
    trajectory_id: str | None = None,
    project: str | None = None,
    experiment: str | None = None,
    step: int | None = None,
    sample_index: int | None = None,
    rollout_n: int | None = None,
    validate: bool | None = None,
    done: bool | None = None,
    token: str | None = None,
    timeout: float = 10.0,
) -> str:
    """Attach to one trajectory, named by `trajectory_id` or by key; returns where it was
    (`open`, `waiting`, `exported`, or `unknown` when this proxy never saw it), or `queued`
    while the calls forwarded before it are still being parsed (it is placed once they are).
    `done=True` closes it now (with or without values)."""
    fields = {
        "reward": reward, "score": score, "labels": labels, "trajectory_id": trajectory_id,
        "project": project, "experiment": experiment, "step": step,
        "sample_index": sample_index, "rollout_n": rollout_n, "validate": validate,
        "done": done,
    }  # fmt: skip
    body = json.dumps({k: v for k, v in fields.items() if v is not None}).encode()
    request = urllib.request.Request(
        admin_url.rstrip("/") + "/rewards",
        data=body,
        headers={"Content-Type": "application/json"}
        | ({"Authorization": f"Bearer {token}"} if token else {}),
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            where: str = json.loads(response.read())["attached_to"]
            return where
    except urllib.error.HTTPError as exc:
        message = json.loads(exc.read() or b"{}").get("error", exc.reason)
        raise RewardRejected(f"{exc.code}: {message}") from None
