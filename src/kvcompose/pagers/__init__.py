"""Pagers: what an eviction does to the paged store's memory.

The contract is in :mod:`kvcompose.pagers.base`; each registered pager has its own
module, named after it.
"""

from .base import Pager
from .ct import ContinuousThinkingPager
from .gather import GatherPager
from .share import SharePager

__all__ = ["ContinuousThinkingPager", "GatherPager", "Pager", "SharePager"]
