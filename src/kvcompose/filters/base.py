"""The sharing-filter contract: which sealed blocks of a finished reasoning step reuse earlier ones.

A filter is configuration plus the decision rule; the cache's :class:`~kvcompose.runtime.sharing.SharingTracker`
finds the steps and their blocks, measures block distances when asked, and applies the
decisions through the ``share`` pager. Each sequence keeps its own history
(:meth:`SharingFilter.new_row`), so a sequence decides the same in a batch as alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .lexical import StepText
from .structure import Tree


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
