"""Triggers: decide when a layer compresses and how many tokens each sequence keeps.

The contract is in :mod:`kvcompose.triggers.base`; each registered trigger has its own
module.
"""

from .base import Trigger, TriggerInput
from .buffer import Buffer
from .interval import Interval
from .over_budget import OverBudget
from .segment_end import SegmentEnd

__all__ = ["Buffer", "Interval", "OverBudget", "SegmentEnd", "Trigger", "TriggerInput"]
