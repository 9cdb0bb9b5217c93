"""On the CPU, the reference attention reads only the columns a source's rows have written.

The kernels stop each row's loop at its device-side count of written columns; the torch
reference gathers whole block tables, so on the CPU a policy that reserves room for much
more than it holds (ThinKV reserves a budget for each thought class) paid for all of it.
On the CPU a host read of that count costs nothing, so the reference first cuts the table
to the blocks written. On CUDA nothing changes: a host read there would break graph capture.
"""

from __future__ import annotations

import dataclasses

from .formats import PagedSource


def written_part(src: PagedSource) -> PagedSource:
    """``src`` with its block table cut to the blocks some row has written (CPU sources with an
    extent); any other source as it is. The columns dropped hold no valid slot of any row."""
    if src.extent is None or src.table.is_cuda or src.extent.numel() == 0:
        return src
    blocks = -(-int(src.extent.max()) // src.block_size)
    if blocks >= src.table.shape[1]:
        return src
    return dataclasses.replace(src, table=src.table[:, :blocks])
