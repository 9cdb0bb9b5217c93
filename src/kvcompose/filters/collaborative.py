"""The ``collaborative`` filter: ReasonCache's two-stage step match, then block distance.

From "ReasonCache: Accelerating Large Reasoning Model Serving through KV Cache Sharing"
(Chen et al., arXiv:2507.21433), §IV-A. Earlier steps whose bag of token ids is close
enough to the finished step's (lexical stage, dynamic threshold, :mod:`.lexical`) and,
for steps with code or formulas, whose syntax trees match (structural stage,
:mod:`.structure`) are candidates; the j-th sealed block of the finished step is compared
with the j-th sealed block of each candidate by Euclidean distance of keys and values
averaged over layers, and shared with the closest one when that distance is at most the
``percentile``-th percentile of the distances this sequence has seen (after ``warmup``
decisions that only collect).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..registry import register
from ..validation import is_int_at_least, is_number_in
from .base import Pair, SharingFilter, Step
from .lexical import lexical_candidates
from .structure import structurally_compatible, structure_of


@register("filter", "collaborative")
@dataclass
class CollaborativeFilter(SharingFilter):
    """ReasonCache's filter: lexical + structural step match, then block distance under an adaptive percentile."""

    delimiter: str = "\n\n"  # what ends a reasoning step
    tau_strict: float = 0.9  # lexical threshold when earlier steps are unlike this one
    tau_soft: float = 0.7  # lexical threshold when they are all alike (the threshold slides with their mean)
    structural: bool = True  # compare syntax trees of steps with code or formulas
    max_tree_distance: int = 0  # tree edit distance still accepted
    percentile: float = 80.0  # share when the distance is at most this percentile of the row's distances
    warmup: int = 8  # decisions that only collect distances before anything is shared

    def __post_init__(self) -> None:
        self.check()
        owner = "collaborative filter"
        for name in ("tau_strict", "tau_soft"):
            v = getattr(self, name)
            if not is_number_in(v, 0.0, 1.0):
                raise ValueError(f"{owner}: {name}={v!r}; accepted: a number in [0, 1]")
        if self.tau_soft > self.tau_strict:
            raise ValueError(f"{owner}: tau_soft={self.tau_soft} is above tau_strict={self.tau_strict}; "
                             "the soft threshold must not exceed the strict one")
        if not isinstance(self.structural, bool):
            raise ValueError(f"{owner}: structural must be true or false, got {self.structural!r}")
        for name, low in (("max_tree_distance", 0), ("warmup", 0)):
            v = getattr(self, name)
            if not is_int_at_least(v, low):
                raise ValueError(f"{owner}: {name}={v!r}; accepted: an integer >= {low}")
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 100.0:
            raise ValueError(f"{owner}: percentile={p!r}; accepted: a number in (0, 100]")

    def prepare(self, step: Step) -> None:
        if self.structural:
            step.tree = structure_of(step.text.text)

    def candidates(self, current: Step, earlier: Sequence[Step]) -> list[int]:
        """Stage 1: earlier steps lexically close enough, and structurally equal where formal."""
        picked, _, _ = lexical_candidates(current.text, [s.text for s in earlier], self.tau_strict, self.tau_soft)
        if self.structural:
            picked = [k for k in picked
                      if structurally_compatible(current.tree, earlier[k].tree, self.max_tree_distance)]
        return picked

    def pairs(self, current, earlier):
        picked = [k for k in self.candidates(current, earlier) if earlier[k].blocks > 0]
        return [(j, k, j) for j in range(current.blocks) for k in picked if j < earlier[k].blocks]

    def decide(self, row, current, earlier, pairs, distances):
        best: dict[int, tuple[float, Pair]] = {}
        for pair, d in zip(pairs, distances):
            if pair[0] not in best or d < best[pair[0]][0]:
                best[pair[0]] = (d, pair)
        row.decisions += len(best)
        out = []
        for j in sorted(best):
            d, pair = best[j]
            if len(row.distances) >= self.warmup and d <= percentile(row.distances, self.percentile):
                out.append(pair)
            row.distances.append(d)
        return out


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` with linear interpolation (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    at = (len(ordered) - 1) * p / 100.0
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)
