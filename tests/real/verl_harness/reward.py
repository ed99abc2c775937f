"""verl's custom reward function hook (`reward.custom_reward_function`): a deterministic score
of the response text, so the test can check that the reward verl computed is the one recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# verl's overrides that make this its reward function, with the one reward worker a CPU holds.
OVERRIDES = (
    f"reward.custom_reward_function.path={Path(__file__)}",
    "reward.custom_reward_function.name=compute_score",
    "reward.num_workers=1",
)


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    return round(len(solution_str) % 97 / 97.0, 6)
