"""verl's custom reward function hook (`reward.custom_reward_function`): a deterministic score
of the response text, so the test can check that the reward verl computed is the one recorded."""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    return round(len(solution_str) % 97 / 97.0, 6)
