"""Triggers: decide when a layer compresses and how many tokens each sequence keeps.

A trigger is a small registered dataclass whose :meth:`plan` maps the per-row token
counts of one layer to the per-row number of tokens to keep. A row whose plan equals
its stored count is left alone, so rows of one batch compress independently without
Python loops over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import register


@dataclass
class TriggerInput:
    """Per-row counts of one layer after the step's tokens were appended (all ``[B]`` int64)."""

    stored: torch.Tensor  # live tokens held (prompt + generated)
    prompt: torch.Tensor  # live prompt tokens held
    generated: torch.Tensor  # generated tokens seen so far (kept or not)
    budget: int | None  # the policy's token budget per (sequence, layer)
    segment: int = 0  # the policy's refresh period (tokens per thought segment)


class Trigger:
    """Base class for triggers."""

    #: Whether the trigger reads ``TriggerInput.budget`` (a policy without a budget is then rejected).
    needs_budget: bool = True

    def plan(self, counts: TriggerInput) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

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


@register("trigger", "over_budget")
@dataclass
class OverBudget(Trigger):
    """Every step, trim each row that holds more than the budget back to the budget."""

    trims_every_step = True

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        if counts.budget is None:
            return counts.stored
        return counts.stored.clamp(max=counts.budget)

    def headroom(self, counts: TriggerInput) -> int | None:
        return 1


def _check_int(trigger: str, name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{trigger} trigger: {name} must be an int >= {low}, got {value!r}")


@register("trigger", "buffer")
@dataclass
class Buffer(Trigger):
    """R-KV's schedule: let ``buffer`` new tokens pile up beyond the budget, then compress back to the budget.

    Scoring a whole buffer at once costs one eviction per ``buffer`` steps instead
    of one per step, at ``buffer`` extra slots of memory.
    """

    buffer: int = 128  # tokens allowed beyond the budget before compressing (R-KV B_buffer)

    def __post_init__(self) -> None:
        _check_int("buffer", "buffer", self.buffer, 0)

    def plan(self, counts: TriggerInput) -> torch.Tensor:
        if counts.budget is None:
            raise ValueError("buffer trigger needs a budget (the policy has none)")
        full = counts.stored >= counts.budget + self.buffer
        return torch.where(full, counts.budget, counts.stored)

    def headroom(self, counts: TriggerInput) -> int | None:
        return self.buffer


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
        _check_int("interval", "period", self.period, 1)
        _check_int("interval", "ratio", self.ratio, 1)
        _check_int("interval", "recent", self.recent, 0)
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
        if counts.budget is None:
            return counts.stored
        return counts.stored.clamp(max=counts.budget)

    def fires(self, counts: TriggerInput, keep: torch.Tensor) -> torch.Tensor:
        if counts.segment < 1:
            raise ValueError("segment_end trigger needs the policy's refresh period (Policy.refresh >= 1)")
        return (counts.generated > 0) & (counts.generated % counts.segment == 0)

    def headroom(self, counts: TriggerInput) -> int | None:
        return counts.segment
