"""Paged KV store: block pools per storage format, regions per token class, and pagers.

:class:`LayerStore` is the one store class callers use. It is assembled from one base
per concern, so each module reads on its own: ``store`` (state, eager append, dense
view), ``store_static`` (fixed-capacity mode for CUDA-graph decode), ``store_sources``
(in-place reads for attention and evictors), ``store_memory`` (byte accounting, free
block return) and ``store_checks`` (input checks, device error flags).
"""

from .codec import DenseCodec, SlotCodec
from .ct import ContinuousThinkingPager
from .gather import GatherPager, Pager
from .pool import BlockPool
from .region import Region
from .share import SharePager
from .store import LayerStore, StoreView

__all__ = ["BlockPool", "ContinuousThinkingPager", "DenseCodec", "GatherPager", "LayerStore", "Pager", "Region", "SharePager", "SlotCodec", "StoreView"]
