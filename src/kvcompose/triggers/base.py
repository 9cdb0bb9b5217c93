"""The trigger contract: decide when a layer compresses and how many tokens each sequence keeps.

A trigger is a small registered dataclass whose :meth:`Trigger.plan` maps the per-row
token counts of one layer to the per-row number of tokens to keep. A row whose plan
equals its stored count is left alone, so rows of one batch compress independently
without Python loops over sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class TriggerInput:
    """Per-row counts of one layer after the step's tokens were appended (all ``[B]`` int64)."""

    stored: torch.Tensor  # live tokens held (prompt + generated)
    prompt: torch.Tensor  # live prompt tokens held
    generated: torch.Tensor  # generated tokens seen so far (kept or not)
    budget: int | None  # the policy's token budget per (sequence, layer)
    segment: int = 0  # the policy's refresh period (tokens per thought segment)


class Trigger(ABC):
    """Base class for triggers."""

    #: Whether the trigger reads ``TriggerInput.budget`` (a policy without a budget is then rejected).
    needs_budget: bool = True

    @abstractmethod
    def plan(self, counts: TriggerInput) -> torch.Tensor:
        """Tokens each row keeps now (``[B]``; a row's stored count where it keeps all)."""

    def fires(self, counts: TriggerInput, keep: torch.Tensor) -> torch.Tensor:
        """Rows that compress this step (``[B]`` bool); by default those asked to keep fewer tokens."""
        return keep < counts.stored

    def min_budget(self) -> int:
        """Smallest budget this trigger can work with (beyond the policy's protected tokens)."""
        return 1

    #: Whether :meth:`plan` is ``min(stored, budget)`` at every step, so that a row that
    #: gains one token per step drops at most one (static decode then needs no sort).
    trims_every_step: bool = False

    def headroom(self, counts: TriggerInput) -> int | None:
        """Most tokens a row at or under the budget gains before this trigger brings it back
        (what static decode reserves beyond the budget); None: no bound (memory follows the length)."""
        return None


def trim_to_budget(counts: TriggerInput) -> torch.Tensor:
    """Each row's stored count, capped at the budget (no budget: keep everything)."""
    if counts.budget is None:
        return counts.stored
    return counts.stored.clamp(max=counts.budget)
