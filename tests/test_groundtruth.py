"""Ground truth: 300+ realistic RL rollouts through the proxy, scored against what happened.

Two modes: every call carries its full key in `X-Rollout-*` headers (the records must be
exact), or no metadata at all (the trajectories are inferred from the traffic, >= 0.99).
`pytest -s tests/test_groundtruth.py` prints the report of each mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from groundtruth.generator import run_mode
from groundtruth.scoring import PR, Ratio, Score, format_report, score

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer

INFERRED = 0.99  # the bar without metadata


def _below(name: str, value: float, bar: float) -> list[str]:
    return [] if value >= bar else [f"{name} {value:.4f} < {bar}"]


def _pr(name: str, pr: PR, bar: float) -> list[str]:
    return _below(f"{name} precision", pr.precision, bar) + _below(f"{name} recall", pr.recall, bar)


def _ratio(name: str, ratio: Ratio, bar: float) -> list[str]:
    return _below(f"{name} ({ratio.hit}/{ratio.total})", ratio.value, bar)


def missed_targets(result: Score) -> list[str]:
    """Every target the records miss: exact with headers, >= 0.99 without."""
    bar = 1.0 if result.with_headers else INFERRED
    missed = [
        *_pr("trajectory grouping", result.grouping, bar),
        *_pr("tool spans", result.tools, bar),
        *_ratio("parallel tool-call turns", result.parallel, bar),
        *_pr("tool errors", result.tool_errors, bar),
        *_ratio("resumed generates merged", result.resumes, bar),
        *_ratio("steps", result.steps, bar),
        *_pr("groups", result.groups, bar),
        *_ratio("rollout_n", result.rollout_n, bar),
    ]
    if result.with_headers:
        missed += _ratio("exact trajectories", result.exact, 1.0)
        missed += _ratio("validation", result.validation, 1.0)
    elif not result.steps_separated:
        missed.append("inferred steps do not separate the training steps and validation")
    return missed


@pytest.mark.parametrize("with_headers", [True, False], ids=["headers", "no-metadata"])
async def test_records_reconstruct_the_ground_truth(
    qwen_tokenizer: Any, tmp_path: Path, with_headers: bool
) -> None:
    truth, records = await run_mode(
        qwen_tokenizer, str(ensure_qwen_tokenizer()), tmp_path, with_headers
    )
    result = score(truth, records, with_headers)
    print("\n" + format_report(result))
    # The run is what it claims to be (about the generator, not the proxy).
    assert len(truth.trajectories) >= 300
    assert {len(t.calls) for t in truth.trajectories} >= {1, 2, 3, 4, 5}
    assert result.parallel.total > 0 and result.tool_errors.true > 0 and result.resumes.total > 0
    assert result.ambiguous_groups == 0, "rollouts of a group must differ to be recoverable"
    assert result.missing_requests == 0
    missed = missed_targets(result)
    assert not missed, "records miss the ground truth:\n" + "\n".join(missed)
