"""The pager contract: a pager owns what eviction means for memory.

After an evictor has chosen the tokens a layer keeps, the pager applies that keep mask
to the layer's paged store: it copies kept tokens into fresh blocks, marks evicted
slots free in place, or maps blocks onto one another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..paging.store import LayerStore, StoreView


class Pager(ABC):
    """Base class: :meth:`compact` applies one layer's keep mask to its store."""

    #: The most blocks beyond its live tokens that a class of a row keeps after :meth:`compact`
    #: in static mode (None: no bound); see :attr:`~kvcompose.Policy.static_hole_blocks`.
    static_hole_blocks: int | None = None

    @abstractmethod
    def compact(self, store: LayerStore, view: StoreView, keep: torch.Tensor) -> None:
        """Apply ``keep`` (``[B, L]`` over ``view``'s slots) to ``store``: what is not kept frees memory."""
