"""The ``segment_end`` trigger: ThinKV's check at the end of every thought segment.

From "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning Models"
(Ramachandran et al., arXiv:2510.01290): thought-based eviction runs when a segment of
``refresh`` generated tokens completes, not at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Trigger, TriggerInput, trim_to_budget


@register("trigger", "segment_end")
@dataclass
class SegmentEnd(Trigger):
    """ThinKV's schedule: act when a thought segment (the policy's ``refresh`` tokens) completes.

    The evictor then steps segments down: all earlier ones if the finished segment
    was a transition, and the oldest least important ones while the row holds more
    than the budget. Checking only at segment ends keeps the eviction call rate near
    ``1 / refresh``; between checks a row may exceed the budget by up to one segment.
    """

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        return trim_to_budget(counts)

    def fires(self, counts: TriggerInput, keep: torch.Tensor) -> torch.Tensor:
        if counts.segment < 1:
            raise ValueError("segment_end trigger needs the policy's refresh period (Policy.refresh >= 1)")
        return (counts.generated > 0) & (counts.generated % counts.segment == 0)

    def headroom(self, counts: TriggerInput) -> int | None:
        return counts.segment
