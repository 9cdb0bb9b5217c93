"""Sharing filters: which sealed blocks of a finished reasoning step reuse earlier ones.

A filter is configuration plus the decision rule; the cache's :class:`~kvcompose.runtime.sharing.SharingTracker`
finds the steps and their blocks, measures block distances when asked, and applies the
decisions through the ``share`` pager. Each sequence keeps its own history
(:meth:`SharingFilter.new_row`), so a sequence decides the same in a batch as alone.

``collaborative`` is ReasonCache's two-stage filter (§IV-A): earlier steps whose bag of
token ids is close enough to the finished step's (lexical stage, dynamic threshold) and,
for steps with code or formulas, whose syntax trees match (structural stage) are
candidates; the j-th sealed block of the finished step is compared with the j-th sealed
block of each candidate by Euclidean distance of keys and values averaged over layers,
and shared with the closest one when that distance is at most the ``percentile``-th
percentile of the distances this sequence has seen (after ``warmup`` decisions that only
collect). ``random`` is the paper's baseline: the same blocks, shared with a uniformly
random earlier block at a fixed rate.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..registry import register
from .lexical import StepText, lexical_candidates
from .structure import Tree, structurally_compatible, structure_of


@dataclass
class Step:
    """One finished reasoning step of one sequence."""

    first: int  # column (absolute position) of its first token
    last: int  # column of its last token (the one that completed the delimiter)
    text: StepText
    tree: Tree | None = None  # formal structure, when the filter checks it
    blocks: int = 0  # its own sealed blocks (all tokens inside the step), in every layer


@dataclass
class RowHistory:
    """What one sequence's filter remembers between decisions."""

    distances: list[float] = field(default_factory=list)  # best distance of every decision so far
    rng: _random.Random | None = None
    decisions: int = 0  # blocks this sequence has decided on (compared with a candidate, or drawn for)


#: Pairs to measure: ``(block j of the finished step, earlier step index k, block j of step k)``.
Pair = tuple[int, int, int]


class SharingFilter(ABC):
    """Base class of the ``filter`` components (registered dataclasses)."""

    needs = "text"
    delimiter: str = "\n\n"

    def check(self) -> None:
        d = self.delimiter
        if not isinstance(d, str) or not d:
            raise ValueError(f"{self.name} filter: delimiter must be a non-empty string, got {d!r}")

    def new_row(self, prompt_ids: Sequence[int]) -> RowHistory:
        return RowHistory()

    def prepare(self, step: Step) -> None:
        """Compute once what later comparisons with ``step`` need (at its end)."""

    def pairs(self, current: Step, earlier: Sequence[Step]) -> list[Pair]:
        """The block pairs whose distance :meth:`decide` needs (none by default)."""
        return []

    @abstractmethod
    def decide(self, row: RowHistory, current: Step, earlier: Sequence[Step], pairs: list[Pair],
               distances: Sequence[float]) -> list[Pair]:
        """The blocks of ``current`` to share, each with the earlier block it maps onto, given the
        measured ``distances`` of :meth:`pairs` (the tracker measures every sequence's pairs at once)."""

    def choose(self, row: RowHistory, current: Step, earlier: Sequence[Step],
               distances: Callable[[list[Pair]], list[float]]) -> list[Pair]:
        """:meth:`pairs`, their distances, then :meth:`decide` (one sequence at a time)."""
        pairs = self.pairs(current, earlier)
        return self.decide(row, current, earlier, pairs, distances(pairs) if pairs else [])


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
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{owner}: {name}={v!r}; accepted: a number in [0, 1]")
        if self.tau_soft > self.tau_strict:
            raise ValueError(f"{owner}: tau_soft={self.tau_soft} is above tau_strict={self.tau_strict}; "
                             "the soft threshold must not exceed the strict one")
        if not isinstance(self.structural, bool):
            raise ValueError(f"{owner}: structural must be true or false, got {self.structural!r}")
        for name, low in (("max_tree_distance", 0), ("warmup", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
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


@register("filter", "random")
@dataclass
class RandomFilter(SharingFilter):
    """ReasonCache's random baseline: each sealed block of a finished step is shared, at ``rate``, with a random earlier block."""

    delimiter: str = "\n\n"  # what ends a reasoning step (the same decision points as the collaborative filter)
    rate: float = 0.2  # share of a step's sealed blocks that are shared (set it to match another run's)
    seed: int = 0  # with the sequence's prompt, seeds its choices (a sequence decides alike in any batch)

    def __post_init__(self) -> None:
        self.check()
        r = self.rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"random filter: rate={r!r}; accepted: a number in [0, 1]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"random filter: seed must be an integer, got {self.seed!r}")

    def new_row(self, prompt_ids):
        return RowHistory(rng=_random.Random(f"{self.seed}:{','.join(map(str, prompt_ids))}"))

    def decide(self, row, current, earlier, pairs, distances):
        pool = [(k, i) for k, s in enumerate(earlier) for i in range(s.blocks)]
        row.decisions += current.blocks if pool else 0
        out = []
        for j in range(current.blocks):
            if pool and row.rng.random() < self.rate:
                k, i = pool[row.rng.randrange(len(pool))]
                out.append((j, k, i))
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
