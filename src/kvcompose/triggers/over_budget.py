"""The ``over_budget`` trigger: trim every row back to the budget at every step.

With the ``window`` evictor and protected sinks this is the schedule of StreamingLLM,
"Efficient Streaming Language Models with Attention Sinks" (Xiao et al., arXiv:2309.17453),
and H2O's, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (Zhang et al., arXiv:2306.14048): the cache never holds more than the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Trigger, TriggerInput, trim_to_budget


@register("trigger", "over_budget")
@dataclass
class OverBudget(Trigger):
    """Every step, trim each row that holds more than the budget back to the budget."""

    trims_every_step = True

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        return trim_to_budget(counts)

    def headroom(self, counts: TriggerInput) -> int | None:
        return 1
