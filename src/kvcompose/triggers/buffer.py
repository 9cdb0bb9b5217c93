"""The ``buffer`` trigger: R-KV's decoding schedule.

From "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (Cai et al.,
arXiv:2505.24133): new tokens pile up in a buffer beyond the budget and the cache is
compressed back to the budget once the buffer is full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from ..validation import check_int
from .base import Trigger, TriggerInput


@register("trigger", "buffer")
@dataclass
class Buffer(Trigger):
    """R-KV's schedule: let ``buffer`` new tokens pile up beyond the budget, then compress back to the budget.

    Scoring a whole buffer at once costs one eviction per ``buffer`` steps instead
    of one per step, at ``buffer`` extra slots of memory.
    """

    buffer: int = 128  # tokens allowed beyond the budget before compressing (R-KV B_buffer)

    def __post_init__(self) -> None:
        check_int("buffer trigger: buffer", self.buffer, 0)

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        if counts.budget is None:
            raise ValueError("buffer trigger needs a budget (the policy has none)")
        full = counts.stored >= counts.budget + self.buffer
        return torch.where(full, counts.budget, counts.stored)

    def headroom(self, counts: TriggerInput) -> int | None:
        return self.buffer
