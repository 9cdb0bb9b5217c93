"""The cost model of one decode step of the paged attention: the bytes it must read."""

from __future__ import annotations

import torch

from .formats import PagedSource


def bytes_read(sources: list[PagedSource], query: torch.Tensor) -> int:
    """Bytes the kernel must read for one step: codes, scales, tables, validity and queries."""
    total = query.numel() * query.element_size()
    for src in sources:
        total += src.table.numel() * 4 + src.valid.numel() * src.valid.element_size()
        for op in (src.key, src.value):
            for t in (op.codes, op.scale, op.minimum, op.head_scale):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total
