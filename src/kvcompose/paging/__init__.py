"""Paged KV store: block pools per storage format, regions per token class, slot codecs.

:class:`LayerStore` is the one store class callers use. It is assembled from one base
per concern, so each module reads on its own: ``store`` (state, eager append, dense
view), ``store_static`` (fixed-capacity mode for CUDA-graph decode), ``store_sources``
(in-place reads for attention and evictors), ``store_memory`` (byte accounting, free
block return) and ``store_checks`` (input checks, device error flags). What an eviction
does to the store is up to a pager (:mod:`kvcompose.pagers`).
"""

from .codec import DenseCodec, SlotCodec
from .pool import BlockPool
from .region import Region
from .store import LayerStore, StoreView

__all__ = ["BlockPool", "DenseCodec", "LayerStore", "Region", "SlotCodec", "StoreView"]
