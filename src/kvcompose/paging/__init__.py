"""Paged KV store: block pools per storage format, regions per token class, slot codecs.

What an eviction does to the store is up to a pager (:mod:`kvcompose.pagers`).
"""

from .codec import DenseCodec, SlotCodec
from .pool import BlockPool
from .region import Region
from .store import LayerStore, StoreView

__all__ = ["BlockPool", "DenseCodec", "LayerStore", "Region", "SlotCodec", "StoreView"]
