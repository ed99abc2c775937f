"""What really happened in a ground-truth run, written down by the agents as they act.

HTTP requests are identified by the id the server put in its response (`chatcmpl-…`,
`cmpl-…`, `generate-tokens-…`, SGLang `rid`): the recorded calls carry the same ids, in
`request_id` and in the `segments` of a merged call. The prompts of one batched request share
its id: each is named by the id and its reply's text (`<id>#<text>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrueTool:
    """One tool execution: asked for by logical call `requested_by` of its trajectory."""

    name: str
    arguments: str  # canonical JSON
    result: str
    requested_by: int
    parallel: int  # how many calls the same turn made
    error: bool


@dataclass
class TrueCall:
    """One logical generate: one HTTP request, or several when it was interrupted and resumed."""

    request_ids: list[str]
    output_ids: list[int] | None  # token dialects: every generated id, across the segments
    finish_reason: str | None


@dataclass
class TrueTrajectory:
    """One rollout. `group` names its GRPO group: rollouts sharing the first prompt."""

    id: str
    variant: str  # dialect variant, e.g. "vllm.chat.stream"
    backend: str  # "vllm" or "sglang": which proxy and fake served it
    step: int
    validate: bool
    sample_index: int
    rollout_n: int
    group: str
    calls: list[TrueCall] = field(default_factory=list)
    tools: list[TrueTool] = field(default_factory=list)
    first_reply: str = ""  # the first response, to check rollouts of a group differ

    @property
    def request_ids(self) -> list[str]:
        return [rid for call in self.calls for rid in call.request_ids]


@dataclass
class Truth:
    trajectories: list[TrueTrajectory] = field(default_factory=list)

    def by_request(self) -> dict[str, tuple[TrueTrajectory, int]]:
        """Every HTTP request id -> (its trajectory, its logical call's index)."""
        out: dict[str, tuple[TrueTrajectory, int]] = {}
        for trajectory in self.trajectories:
            for index, call in enumerate(trajectory.calls):
                for rid in call.request_ids:
                    out[rid] = (trajectory, index)
        return out
