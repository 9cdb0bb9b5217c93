"""The cost model of one decode step of the paged attention: the bytes it must read."""

from __future__ import annotations

import torch

from .formats import PagedSource


def bytes_read(sources: list[PagedSource], query: torch.Tensor) -> int:
    """Bytes the kernel must read for one step: codes, scales, tables (as int32), validity and
    queries. Sources that are regions of one pool (ThinKV's R and E) share its tensors: each
    tensor counts once, however many sources read from it."""
    spans = {_span(query)}
    for src in sources:
        spans |= {(src.table.data_ptr(), src.table.numel() * 4), _span(src.valid)}
        for op in (src.key, src.value):
            spans |= {_span(t) for t in (op.codes, op.scale, op.minimum, op.head_scale) if t is not None}
    return sum(size for _, size in spans)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor starts and how many bytes it holds: two views of one storage with the
    same span are the same read."""
    return t.data_ptr(), t.numel() * t.element_size()
