"""Masked writes to pool slots by index, in static decode's fixed shapes.

An eviction clears the slots it evicts; a pack moves a class's newest tokens into its holes.
Both are given as a ``[B, L]`` grid of slot indexes and a mask, so that their shapes never
depend on the data. In torch ops every masked-out entry must still be written somewhere, to
one trash slot, and on a GPU hundreds of thousands of writes to one address run one after
another: at ThinKV's largest batches an eviction step took seconds. :func:`fill_slots` and
:func:`copy_slots` skip masked-out entries in their kernels instead.

:func:`fill_slots_torch` and :func:`copy_slots_torch` are the plain-torch references (and the
CPU path), with the trash slot.
"""

from __future__ import annotations

import torch

from .dispatch import step_kernel_runs
from .paged_attention.formats import head_major_rows, to_head_major
from .triton_shim import jit, next_pow2, tl

ELEMENTS = 4096  # elements a program writes (slots x words per slot)


@jit
def _fill_kernel(flat_ptr, index_ptr, mask_ptr, value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    take = (tl.load(mask_ptr + i, mask=i < n, other=0) != 0) & (i < n)
    slot = tl.load(index_ptr + i, mask=take, other=0)
    value = tl.load(value_ptr) + tl.zeros([BLOCK], dtype=flat_ptr.dtype.element_ty)
    tl.store(flat_ptr + slot, value, mask=take)


@jit
def _copy_kernel(rows_ptr, source_ptr, target_ptr, mask_ptr, n, slots, E: tl.constexpr, E_P: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Rows ``[heads, slots, E]`` (``program_id(1)``: the head; one head when the rows are whole slots)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    take = (tl.load(mask_ptr + i, mask=i < n, other=0) != 0) & (i < n)
    source = tl.load(source_ptr + i, mask=take, other=0)
    target = tl.load(target_ptr + i, mask=take, other=0)
    base = rows_ptr + tl.program_id(1).to(tl.int64) * slots * E
    e = tl.arange(0, E_P)
    at = take[:, None] & (e < E)[None, :]
    words = tl.load(base + source[:, None] * E + e[None, :], mask=at)
    tl.store(base + target[:, None] * E + e[None, :], words, mask=at)


def _check(flat: torch.Tensor, mask: torch.Tensor, *indexes: torch.Tensor) -> None:
    if mask.dtype != torch.bool or any(t.dtype != torch.long or t.shape != mask.shape for t in indexes):
        raise ValueError(f"slot indexes must be int64 with the mask's shape {tuple(mask.shape)} and the mask bool; "
                         f"got {[(t.dtype, tuple(t.shape)) for t in indexes]} and {mask.dtype}")
    if not flat.is_contiguous() and not head_major_rows(flat):
        raise ValueError(f"the per-slot tensor must be contiguous or head-major (a pool's flat view); got shape "
                         f"{tuple(flat.shape)} with strides {flat.stride()}, accepted: {flat.contiguous().stride()} or "
                         f"{to_head_major(flat).stride() if flat.dim() >= 3 else 'none (one value per slot)'}")


def fill_slots(flat: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, value, trash: int,
               backend: str | None = None) -> None:
    """``flat[index[mask]] = value``: ``flat`` a pool's per-slot channel ``[S]``, ``index`` and
    ``mask`` ``[B, L]``. ``trash``: the slot the torch reference writes masked-out entries to.
    ``backend`` as the other per-step ops (:func:`~kvcompose.ops.dispatch.step_kernel_runs`)."""
    _check(flat, mask, index)
    if flat.dim() != 1:
        raise ValueError(f"fill_slots writes one value per slot; got a tensor of shape {tuple(flat.shape)}")
    if not step_kernel_runs(mask, _fill_kernel, backend):
        fill_slots_torch(flat, index, mask, value, trash)
        return
    words = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
    fill = torch.full((1,), value, dtype=words.dtype, device=flat.device)
    n = mask.numel()
    _fill_kernel[(triton_blocks(n, 1024),)](words, index.contiguous(), mask.contiguous(), fill, n, BLOCK=1024)


def fill_slots_torch(flat: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, value, trash: int) -> None:
    """Reference of :func:`fill_slots`."""
    flat.index_fill_(0, torch.where(mask, index, trash).reshape(-1), value)


def copy_slots(flat: torch.Tensor, source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, trash: int,
               backend: str | None = None) -> None:
    """``flat[target[mask]] = flat[source[mask]]`` for a per-slot tensor ``[S, ...]`` of a pool;
    no slot may be both a source and a target. Arguments as :func:`fill_slots`."""
    _check(flat, mask, source, target)
    if not step_kernel_runs(mask, _copy_kernel, backend):
        copy_slots_torch(flat, source, target, mask, trash)
        return
    # rows: whole slots, or one head of a slot where each head's rows lie together
    rows = flat.transpose(0, 1).reshape(flat.shape[1], flat.shape[0], -1) if head_major_rows(flat) \
        else flat.view(1, flat.shape[0], -1)
    size = rows.shape[2] * rows.element_size()
    words = rows.view(torch.int32) if size % 4 == 0 else rows.view(torch.uint8)  # whole words where it can
    E = words.shape[2]
    E_P = next_pow2(E)
    block = max(1, ELEMENTS // E_P)
    n = mask.numel()
    _copy_kernel[(triton_blocks(n, block), words.shape[0])](words, source.contiguous(), target.contiguous(),
                                                            mask.contiguous(), n, flat.shape[0], E=E, E_P=E_P,
                                                            BLOCK=block)


def copy_slots_torch(flat: torch.Tensor, source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                     trash: int) -> None:
    """Reference of :func:`copy_slots`: every source is read before any target is written."""
    moved = flat.index_select(0, torch.where(mask, source, trash).reshape(-1))
    flat.index_copy_(0, torch.where(mask, target, trash).reshape(-1), moved)


def triton_blocks(n: int, block: int) -> int:
    """Programs for ``n`` entries, ``block`` each (at least one)."""
    return max(1, -(-n // block))
