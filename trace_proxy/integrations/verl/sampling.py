"""One sampling decision per step, made where verl sees the step's whole batch: its agent-loop
manager.

Each proxy alone would keep the N samples with the smallest keyed hash among the calls it saw,
so N per proxy with a proxy per node. The manager sees every sample index of the step before
any rollout starts: it keeps the N smallest by the same keyed hash (whole GRPO groups,
validation steps by their own N) and names them on every proxy's admin port (`POST
/sampling`), which then keeps exactly those. The same batch gives the same selection on every
rerun, and with one proxy the same one that proxy would have made. A step whose batch reaches
the manager in several parts keeps the first parts' choice and fills what room is left, so it
never keeps more than N. No decision is made when the batch has no `index` column (verl then
numbers samples per worker) or the step keeps every sample.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_proxy.trajectories.sampler import sample_hash

log = logging.getLogger(__name__)
STEPS_REMEMBERED = 64


@dataclass
class StepChooser:
    """The keyed top-N of each step's sample indices, as the proxies' own sampler ranks them."""

    seed: int
    experiment: str
    max_samples: int | None
    validate_max_samples: int | None
    _kept: OrderedDict[tuple[int, bool], list[Any]] = field(default_factory=OrderedDict)
    _seen: dict[tuple[int, bool], set[Any]] = field(default_factory=dict)

    def choose(self, step: int, validate: bool, indices: Iterable[Any]) -> list[Any] | None:
        """The step's kept samples so far (this batch's included); None: keep every one."""
        n = self.validate_max_samples if validate else self.max_samples
        if n is None:
            return None
        key = (step, validate)
        kept = self._kept.setdefault(key, [])
        seen = self._seen.setdefault(key, set())
        new = {index for index in indices if index not in seen}
        seen.update(new)
        ranked = sorted(new, key=lambda s: (sample_hash(self.seed, self.experiment, step,
                                                        validate, s), str(s)))  # fmt: skip
        kept.extend(ranked[: max(n - len(kept), 0)])
        while len(self._kept) > STEPS_REMEMBERED:
            old, _ = self._kept.popitem(last=False)
            self._seen.pop(old, None)
        return list(kept)


@dataclass
class StepDecider:
    """Chooses each step's samples from the manager's batch and tells every proxy."""

    chooser: StepChooser
    admin_urls: Sequence[str]
    admin_token: str | None
    failures: int = 0
    # How many kept samples each step's last message named: a step decided one sample at a
    # time (verl's fully async rollouter) is told again only when its choice grows.
    _told: OrderedDict[tuple[int, bool], int] = field(default_factory=OrderedDict)

    def decide(self, step: Any, validate: bool, indices: Sequence[Any] | None) -> None:
        if indices is None or step is None:
            return
        kept = self.chooser.choose(int(step), bool(validate), [_plain(i) for i in indices])
        if kept is None:
            return
        key = (int(step), bool(validate))
        if self._told.get(key) == len(kept):
            return
        self._told[key] = len(kept)
        while len(self._told) > STEPS_REMEMBERED:
            self._told.popitem(last=False)
        body = json.dumps({"experiment": self.chooser.experiment, "step": int(step),
                           "validate": bool(validate), "kept": kept}).encode()  # fmt: skip
        for admin_url in self.admin_urls:
            request = urllib.request.Request(
                admin_url + "/sampling", data=body, method="POST",
                headers={"Content-Type": "application/json",
                         "Authorization": f"Bearer {self.admin_token}"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=10):
                    pass
            except (urllib.error.URLError, OSError) as exc:
                # That proxy keeps its own top-N of what it sees (at most N) this step.
                self.failures += 1
                if self.failures == 1:
                    log.warning("trace-proxy: a proxy was not told step %s's samples (%s); it "
                                "samples on its own (logged once)", step, exc)  # fmt: skip


def _plain(index: Any) -> Any:
    """A sample index as JSON and the proxies' headers write it (numpy ints are ints)."""
    item = getattr(index, "item", None)
    return item() if callable(item) else index
