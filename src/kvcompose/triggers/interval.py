"""The ``interval`` trigger: RPC's periodic compression.

From "Reasoning Path Compression: Compressing Generation Trajectories for Efficient LLM
Reasoning" (Song et al., arXiv:2505.13866): every ``period`` generated tokens the
generated part of the cache shrinks to a fixed share of its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from ..validation import check_int
from .base import Trigger, TriggerInput


@register("trigger", "interval")
@dataclass
class Interval(Trigger):
    """RPC's schedule: every ``period`` generated tokens, keep ``1/ratio`` of the generated tokens so far.

    After the k-th compression a row holds its prompt, the ``k · (period // ratio)``
    best older generated tokens and the ``recent`` selector tokens (RPC §3.3:
    ``kP/c + R``). In between, new tokens are added uncompressed. The plan depends
    only on the counts, so a step that appends several tokens across a multiple of
    ``period`` still compresses, keeping the tokens past the multiple. Needs no
    budget: memory follows the generated length. The policy should protect the
    prompt and the last ``recent`` tokens so the evictor chooses among the rest.
    """

    period: int = 4096  # generated tokens between compressions (RPC P)
    ratio: int = 4  # keep 1/ratio of the generated tokens (RPC c)
    recent: int = 32  # selector-window tokens kept on top of the 1/ratio share (RPC R)

    needs_budget = False

    def __post_init__(self) -> None:
        check_int("interval trigger: period", self.period, 1)
        check_int("interval trigger: ratio", self.ratio, 1)
        check_int("interval trigger: recent", self.recent, 0)
        if self.period < self.ratio:
            raise ValueError(
                f"interval trigger: period ({self.period}) must be >= ratio ({self.ratio}) "
                "so that each compression keeps at least one token"
            )

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        cycles = counts.generated // self.period
        since_last = counts.generated - cycles * self.period
        target = cycles * (self.period // self.ratio) + self.recent + since_last
        generated_held = counts.stored - counts.prompt
        return counts.prompt + torch.minimum(generated_held, target)
