"""Paged KV store: block pools per storage format, regions per token class, and pagers."""

from .codec import DenseCodec, SlotCodec
from .ct import ContinuousThinkingPager
from .gather import GatherPager, Pager
from .pool import BlockPool
from .region import Region
from .share import SharePager
from .store import LayerStore, StoreView

__all__ = ["BlockPool", "ContinuousThinkingPager", "DenseCodec", "GatherPager", "LayerStore", "Pager", "Region", "SharePager", "SlotCodec", "StoreView"]
