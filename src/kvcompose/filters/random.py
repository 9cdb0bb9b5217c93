"""The ``random`` filter: ReasonCache's random-sharing baseline.

From "ReasonCache: Accelerating Large Reasoning Model Serving through KV Cache Sharing"
(Chen et al., arXiv:2507.21433): the same decision points as the collaborative filter,
but each sealed block of a finished step is shared with a uniformly random earlier block
at a fixed rate. Compared at the same share rate, it shows what choosing the blocks is
worth.
"""

from __future__ import annotations

import random as _random
from dataclasses import dataclass

from ..registry import register
from ..validation import is_number_in
from .base import RowHistory, SharingFilter


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
        if not is_number_in(r, 0.0, 1.0):
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
