"""Evictors: decide which tokens of a (sequence, layer) survive compression.

The contract is in :mod:`kvcompose.evictors.base`; each registered evictor has its own
module, named after it.
"""

from .attention import AttentionEvictor
from .base import EvictionContext, Evictor, keep_top
from .h2o import H2OEvictor
from .rkv import RKVEvictor
from .tbe import ThoughtEvictor
from .window import WindowEvictor

__all__ = ["AttentionEvictor", "EvictionContext", "Evictor", "H2OEvictor", "RKVEvictor", "ThoughtEvictor", "keep_top",
           "WindowEvictor"]
