"""Move each row's kept entries, in order, to the front of the row, in place; the rest take a fill value.

A compaction of a store's recent buffer does this to every buffer tensor (keys, values, each
metadata channel). In torch ops it costs a sort for the order and a gather, a select and a copy
per tensor, each its own launch inside a captured eviction step, where launches, not bytes, set
the time. The kernel does one tensor in one launch: each program reads its columns of a whole
row, finds every kept entry's place by a running count, and writes the row back.

:func:`compact_rows_torch` is the plain-torch reference (and the CPU path).
"""

from __future__ import annotations

import math

import torch

from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl

ELEMENTS = 4096  # words a program holds (entries x words per entry)


@jit
def _compact_rows_kernel(x_ptr, keep_ptr, fill, N, E, N_P: tl.constexpr, E_BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``x`` (``[B, N, E]`` words, contiguous), words ``program_id(1)``'s block."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_P)
    inside = i < N
    kept = (tl.load(keep_ptr + row * N + i, mask=inside, other=0) != 0) & inside
    place = tl.cumsum(kept.to(tl.int32), 0) - 1
    count = tl.sum(kept.to(tl.int32), 0)
    e = tl.program_id(1) * E_BLOCK + tl.arange(0, E_BLOCK)
    cols = (e < E)[None, :]
    base = x_ptr + row * N * E
    words = tl.load(base + i[:, None] * E + e[None, :], mask=inside[:, None] & cols, other=0)
    tl.debug_barrier()  # the whole tile is read before any of it is overwritten
    tl.store(base + place[:, None] * E + e[None, :], words, mask=kept[:, None] & cols)
    empty = (tl.zeros([N_P, E_BLOCK], dtype=tl.int32) + fill).to(x_ptr.dtype.element_ty)
    tl.store(base + i[:, None] * E + e[None, :], empty, mask=(inside & (i >= count))[:, None] & cols)


def compact_rows_(x: torch.Tensor, keep: torch.Tensor, fill: int = 0, backend: str | None = None) -> torch.Tensor:
    """In place: row ``b`` of ``x`` (``[B, N, ...]``, contiguous) takes its entries where ``keep[b]``
    (``[B, N]`` bool), in their order, in its first ``keep[b].sum()`` places, and ``fill``
    (an integer: 0, or -1 for a position channel) after them. Returns ``x``.
    ``backend`` as the other per-step ops (:func:`~kvcompose.ops.dispatch.step_kernel_runs`)."""
    if keep.dtype != torch.bool or keep.shape != x.shape[:2]:
        raise ValueError(f"keep must be bool of shape {tuple(x.shape[:2])} (the rows and entries of x); "
                         f"got {keep.dtype} of shape {tuple(keep.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"compact_rows_ moves entries of a contiguous tensor; got shape {tuple(x.shape)} with "
                         f"strides {x.stride()}, accepted: {x.contiguous().stride()}")
    if not isinstance(fill, int) or isinstance(fill, bool):
        raise ValueError(f"fill must be an int (0, or -1 for positions); got {fill!r}")
    if not step_kernel_runs(keep, _compact_rows_kernel, backend):
        return compact_rows_torch(x, keep, fill)
    B, N = keep.shape
    if B == 0 or N == 0 or x.numel() == 0:
        return x
    per_entry = math.prod(x.shape[2:]) * x.element_size()
    word = torch.int32 if per_entry % 4 == 0 and fill == 0 else x.dtype  # whole words where the fill allows
    words = x.view(torch.uint8) if word == torch.bool else x.view(word)
    E = words.numel() // (B * N)
    N_P = next_pow2(N)
    block = min(next_pow2(E), max(1, ELEMENTS // N_P))
    _compact_rows_kernel[(B, -(-E // block))](words, keep.contiguous(), fill, N, E, N_P=N_P, E_BLOCK=block)
    return x


def compact_rows_torch(x: torch.Tensor, keep: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Reference of :func:`compact_rows_`: a stable sort puts the kept entries first."""
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    kept = torch.arange(keep.shape[1], device=keep.device)[None, :] < keep.sum(1, keepdim=True)
    trailing = [1] * (x.dim() - 2)
    moved = x.gather(1, order.view(*order.shape, *trailing).expand_as(x))
    x.copy_(torch.where(kept.view(*kept.shape, *trailing), moved, torch.full_like(moved, fill)))
    return x
