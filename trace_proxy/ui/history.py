"""One prompt across training: the steps where the same sample was kept (`Entry.prompt_hash`),
with its rollouts' rewards, lengths and best and worst answers per step, so a page can show how
the policy's answer to that prompt changed.

Worked out from the index alone, except the answers: those are read from the two records a
step shows (its best and worst rollout), a page of steps at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trace_proxy.ui.index import Entry, StepKey
from trace_proxy.ui.views import Piece, Rollouts, rollout_order, trajectory_view

ANSWER_CHARS = 2000  # of an answer shown in full on the page; the trajectory has the rest


@dataclass
class Answer:
    entry: Entry
    text: str
    cut: bool  # the answer is longer than what `text` holds


@dataclass
class StepOfPrompt(Rollouts):
    key: StepKey = (False, None)
    best_answer: Answer | None = None
    worst_answer: Answer | None = None  # None when the step's rewards do not differ

    @property
    def answered(self) -> Entry:
        """The rollout whose answer leads the step: its best, else (rewards alike or none
        known) its first."""
        return self.best or self.rollouts[0]

    @property
    def reward_std(self) -> float | None:
        rewards, mean = self.rewards, self.reward_mean
        if mean is None:
            return None
        return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))

    @property
    def length(self) -> float:
        """Response tokens per rollout."""
        return sum(e.completion_tokens for e in self.rollouts) / len(self.rollouts)

    @property
    def row(self) -> dict[str, Any]:
        """The shape the run page's plots read."""
        return {
            "step": self.key[1], "reward_mean": self.reward_mean,
            "reward_std": self.reward_std, "length": self.length, "tool_calls": None,
        }  # fmt: skip


def steps_of_prompt(entries: Sequence[Entry]) -> list[StepOfPrompt]:
    """`entries` (one prompt's) by step: training steps in order, then validation ones."""
    by_step: dict[StepKey, list[Entry]] = {}
    for entry in entries:
        by_step.setdefault((entry.validate, entry.step), []).append(entry)
    return [
        StepOfPrompt(sorted(by_step[key], key=rollout_order), key)
        for key in sorted(by_step, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    ]


def read_answers(
    steps: Sequence[StepOfPrompt],
    read: Callable[[Entry], dict[str, Any]],
    piece: Piece | None = None,
) -> None:
    """Each step's best and worst answer: the last call's response, from the stored record."""
    for step in steps:
        step.best_answer = _answer(step.answered, read, piece)
        worst = step.worst
        if worst is not None:
            step.worst_answer = _answer(worst, read, piece)


def _answer(entry: Entry, read: Callable[[Entry], dict[str, Any]], piece: Piece | None) -> Answer:
    try:
        view = trajectory_view(read(entry), piece)
    except (OSError, ValueError):  # a line gone or changed since it was indexed
        return Answer(entry, "", False)
    text = view.turns[-1].response if view.turns else ""
    return Answer(entry, text[:ANSWER_CHARS], len(text) > ANSWER_CHARS)
