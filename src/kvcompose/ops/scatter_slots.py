"""Masked writes to pool slots by index, in static decode's fixed shapes.

An eviction clears the slots it evicts; a pack moves a class's newest tokens into its holes;
a compaction moves each row's kept tokens to its first slots; a view gathers every row's slots.
All are given as a ``[B, L]`` grid of slot indexes and a mask, so that their shapes never
depend on the data. In torch ops every masked-out entry must still be written somewhere, to
one trash slot, and on a GPU hundreds of thousands of writes to one address run one after
another: at ThinKV's largest batches an eviction step took seconds. The kernels skip
masked-out entries instead, and move whole rows (a slot, or one head of a slot in a
head-major pool) as words, where torch's indexing of a head-major pool moves one element per
thread.

:func:`fill_slots_torch`, :func:`copy_slots_torch` and :func:`gather_slots_torch` are the
plain-torch references (and the CPU path), with the trash slot.
"""

from __future__ import annotations

import math

import torch

from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl

ELEMENTS = 4096  # elements a program writes (slots x words per slot)


@jit
def _fill_kernel(flat_ptr, index_ptr, mask_ptr, value, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    take = (tl.load(mask_ptr + i, mask=i < n, other=0) != 0) & (i < n)
    slot = tl.load(index_ptr + i, mask=take, other=0)
    filled = (tl.zeros([BLOCK], dtype=tl.int32) + value).to(flat_ptr.dtype.element_ty)
    tl.store(flat_ptr + slot, filled, mask=take)


@jit
def _copy_kernel(tensors, source_ptr, target_ptr, mask_ptr, n, SHAPES: tl.constexpr, BLOCK: tl.constexpr,
                 GATHER: tl.constexpr, SCATTER: tl.constexpr, EVERY: tl.constexpr):
    """For each tensor ``tensors[t] = (src, dst, heads, src_head, src_slot, dst_head, dst_slot, fill, clear)``
    (strides in words) with ``SHAPES[t] = (E, E_P, CLEAR)``: row ``(head, source[i])`` of ``src`` to row
    ``(head, target[i])`` of ``dst`` where ``mask[i]`` (``program_id(1)``: the head; a tensor with
    fewer heads skips the others), then, with ``CLEAR``, the source row set to ``clear`` words (sources
    and targets distinct). ``GATHER``: the target of entry ``i`` is row ``i``, and a masked-out entry
    writes ``fill`` words there; ``SCATTER``: the source of entry ``i`` is row ``i``; ``EVERY``: every
    entry is taken (the mask is not read). One launch moves all of a pool's tensors."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    if EVERY:
        take = inside
    else:
        take = (tl.load(mask_ptr + i, mask=inside, other=0) != 0) & inside
    if SCATTER:
        source = i.to(tl.int64)
    else:
        source = tl.load(source_ptr + i, mask=take, other=0)
    if GATHER:
        target = i.to(tl.int64)
        written = inside
    else:
        target = tl.load(target_ptr + i, mask=take, other=0)
        written = take
    head = tl.program_id(1)
    for t in tl.static_range(len(SHAPES)):
        rows = tensors[t]
        if head < rows[2]:
            e = tl.arange(0, SHAPES[t][1])
            cols = (e < SHAPES[t][0])[None, :]
            h = head.to(tl.int64)
            src_at = rows[0] + h * rows[3] + source[:, None] * rows[4] + e[None, :]
            words = tl.load(src_at, mask=take[:, None] & cols, other=rows[7])
            tl.store(rows[1] + h * rows[5] + target[:, None] * rows[6] + e[None, :], words, mask=written[:, None] & cols)
            if SHAPES[t][2]:
                tl.debug_barrier()  # every source word is read before any is cleared
                cleared = (tl.zeros_like(words).to(tl.int32) + rows[8]).to(words.dtype)
                tl.store(src_at, cleared, mask=take[:, None] & cols)


def per_head_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` ``[S, H, ...]`` is a view of contiguous ``[H, S, ...]`` storage (a head-major pool's
    flat view) and not also contiguous: its rows are copied one head at a time."""
    return t.dim() >= 2 and not t.is_contiguous() and t.transpose(0, 1).is_contiguous()


def _check(flat: torch.Tensor, mask: torch.Tensor, *indexes: torch.Tensor) -> None:
    if mask.dtype != torch.bool or any(t.dtype != torch.long or t.shape != mask.shape for t in indexes):
        raise ValueError(f"slot indexes must be int64 with the mask's shape {tuple(mask.shape)} and the mask bool; "
                         f"got {[(t.dtype, tuple(t.shape)) for t in indexes]} and {mask.dtype}")
    _check_layout(flat)


def _check_layout(flat: torch.Tensor) -> None:
    if not flat.is_contiguous() and not per_head_rows(flat):
        head_major = flat.transpose(0, 1).contiguous().transpose(0, 1).stride() if flat.dim() >= 2 else None
        raise ValueError(f"the per-slot tensor must be contiguous or head-major (a pool's flat view); got shape "
                         f"{tuple(flat.shape)} with strides {flat.stride()}, accepted: {flat.contiguous().stride()} or "
                         f"{head_major or 'none (one value per slot)'}")


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
    scalar = float(value) if flat.dtype.is_floating_point else int(value)  # an argument, not a tensor to fill
    n = mask.numel()
    _fill_kernel[(triton_blocks(n, 1024),)](words, index.contiguous(), mask.contiguous(), scalar, n, BLOCK=1024)


def fill_slots_torch(flat: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, value, trash: int) -> None:
    """Reference of :func:`fill_slots`."""
    flat.index_fill_(0, torch.where(mask, index, trash).reshape(-1), value)


def copy_slots(flat: torch.Tensor, source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, trash: int,
               backend: str | None = None) -> None:
    """``flat[target[mask]] = flat[source[mask]]`` for a per-slot tensor ``[S, ...]`` of a pool;
    no slot may be both a source and a target (:func:`move_slots` allows it). Arguments as
    :func:`fill_slots`."""
    pack_slots([flat], source, target, mask, trash, [None], backend)


def pack_slots(flats: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
               trash: int, clear: list[int | None], backend: str | None = None) -> None:
    """:func:`copy_slots` for several per-slot tensors of one pool in one launch (a pack moves every
    tensor of its tokens), then ``clear[k]`` written to the moved-from slots of ``flats[k]`` where it
    is not None (0, or -1 for an integer tensor: a metadata channel's empty value). Sources are
    distinct and no slot is both a source and a target. Other arguments as :func:`fill_slots`."""
    for flat, value in zip(flats, _fills(flats, clear, "clear")):
        _check(flat, mask, source, target)
        _check_fill(flat, value)
    if not step_kernel_runs(mask, _copy_kernel, backend):
        pack_slots_torch(flats, source, target, mask, trash, clear)
        return
    pairs = [(rows, rows) for rows in map(_Rows, flats)]
    _launch_copy(pairs, source, target, mask, clear=clear)


def pack_slots_torch(flats: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                     trash: int, clear: list[int | None]) -> None:
    """Reference of :func:`pack_slots`."""
    for flat, value in zip(flats, clear):
        copy_slots_torch(flat, source, target, mask, trash)
        if value is not None:
            fill_slots_torch(flat, source, mask, value, trash)


def write_slots(flats: list[torch.Tensor], rows: list[torch.Tensor], index: torch.Tensor,
                backend: str | None = None) -> None:
    """``flats[k][index] = rows[k]`` for several per-slot tensors of one pool in one launch (a write
    of encoded tokens: their codes, scales and metadata). ``index`` ``[M]`` int64 slots (repeats only
    where the content does not matter: the trash slot); ``rows[k]`` ``[M, *flats[k].shape[1:]]`` of
    ``flats[k]``'s dtype. ``backend`` as the other per-step ops."""
    if index.dtype != torch.long or index.dim() != 1:
        raise ValueError(f"slot indexes must be a 1-d int64 tensor; got {index.dtype} of shape {tuple(index.shape)}")
    if len(rows) != len(flats) or not flats:
        raise ValueError(f"one tensor of rows per per-slot tensor; got {len(rows)} for {len(flats)}")
    for flat, row in zip(flats, rows):
        _check_layout(flat)
        if row.dtype != flat.dtype or row.shape != (index.numel(), *flat.shape[1:]):
            raise ValueError(f"rows to write must be {flat.dtype} of shape {(index.numel(), *flat.shape[1:])}; "
                             f"got {row.dtype} of shape {tuple(row.shape)}")
    if not step_kernel_runs(index, _copy_kernel, backend):
        for flat, row in zip(flats, rows):
            flat[index] = row
        return
    pairs = [(_Rows(row.contiguous(), like=flat), _Rows(flat)) for flat, row in zip(flats, rows)]
    _launch_copy(pairs, index, index, index, scatter=True, every=True)  # every entry: the mask is not read


def move_slots(flat: torch.Tensor, source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, trash: int,
               backend: str | None = None, fill: int | None = None) -> None:
    """:func:`copy_slots` where a slot may be both a source and a target (a compaction): every
    source is read, into scratch of the moved rows, before any target is written. ``fill``
    (0, or -1 for an integer tensor): every target is written, a masked-out entry's with ``fill``
    (a compaction's metadata: the slots past a row's kept tokens become empty)."""
    move_slots_many([flat], source, target, mask, trash, backend, None if fill is None else [fill])


def move_slots_many(flats: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                    trash: int, backend: str | None = None, fill: list[int] | None = None) -> None:
    """:func:`move_slots` for several per-slot tensors of one pool in two launches (a gather of
    every tensor's moved rows, then their scatter); ``fill``: one value per tensor, or None."""
    fills = _fills(flats, fill)
    if fill is not None and None in fills:  # every target is written for all tensors, or for none
        raise ValueError(f"fill: one value (0, or -1 for an integer tensor) per tensor, or None; got {fills}")
    for flat, value in zip(flats, fills):
        _check(flat, mask, source, target)
        _check_fill(flat, value)
    if not step_kernel_runs(mask, _copy_kernel, backend):
        for flat, value in zip(flats, fills):
            copy_slots_torch(flat, source, target, mask, trash, value)
        return
    moved = gather_slots_many(flats, source, mask, backend, [value or 0 for value in fills])
    pairs = [(_Rows(m.view(-1, *flat.shape[1:]), like=flat), _Rows(flat)) for m, flat in zip(moved, flats)]
    _launch_copy(pairs, target, target, mask, scatter=True, every=fill is not None)


def gather_slots(flat: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                 backend: str | None = None, fill: int = 0) -> torch.Tensor:
    """``flat[index]`` where ``mask``, ``fill`` elsewhere (0, or -1 for an integer tensor):
    ``[*mask.shape, *flat.shape[1:]]``, contiguous (``index`` may be anything where ``mask`` is
    False). Arguments as :func:`fill_slots`."""
    return gather_slots_many([flat], index, mask, backend, [fill])[0]


def gather_slots_many(flats: list[torch.Tensor], index: torch.Tensor, mask: torch.Tensor,
                      backend: str | None = None, fill: list[int] | None = None) -> list[torch.Tensor]:
    """:func:`gather_slots` for several per-slot tensors of one pool in one launch (``fill``: one
    value per tensor; None: zeros)."""
    fills = [value or 0 for value in _fills(flats, fill)]
    for flat, value in zip(flats, fills):
        _check(flat, mask, index)
        _check_fill(flat, value)
    if not step_kernel_runs(mask, _copy_kernel, backend):
        return [gather_slots_torch(flat, index, mask, value) for flat, value in zip(flats, fills)]
    outs = [torch.empty(*mask.shape, *flat.shape[1:], dtype=flat.dtype, device=flat.device) for flat in flats]
    pairs = [(_Rows(flat), _Rows(out.view(-1, *flat.shape[1:]), like=flat)) for flat, out in zip(flats, outs)]
    _launch_copy(pairs, index, index, mask, gather=True, fill=fills)
    return outs


def _fills(flats: list[torch.Tensor], fill: list | None, what: str = "fill") -> list:
    """One ``what`` value (or None) per tensor, checked against their count."""
    if not flats:
        raise ValueError("no per-slot tensors given")
    fills = [None] * len(flats) if fill is None else list(fill)
    if len(fills) != len(flats):
        raise ValueError(f"one {what} value per tensor; got {len(fills)} for {len(flats)} tensors")
    return fills


def gather_slots_torch(flat: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Reference of :func:`gather_slots`."""
    picked = flat[torch.where(mask, index, 0)]
    return torch.where(mask.view(*mask.shape, *[1] * (flat.dim() - 1)), picked, torch.full_like(picked, fill))


def _check_fill(flat: torch.Tensor, fill: int | None) -> None:
    """The kernels write ``fill`` as whole words: all zero bits, or all one bits (-1 in any integer width)."""
    if fill is None or fill == 0 and not isinstance(fill, bool):
        return
    if fill != -1 or isinstance(fill, bool) or flat.dtype.is_floating_point or flat.dtype == torch.bool:
        raise ValueError(f"fill must be 0, or -1 for an integer tensor; got {fill!r} for {flat.dtype}")


class _Rows:
    """A per-slot tensor ``[S, ...]`` as the copy kernel's rows of words: whole slots, or one head
    of a slot where each head's rows lie together (head-major). ``like``: a contiguous tensor takes
    the per-head rows of that pool tensor (scratch and gather outputs of a head-major pool)."""

    def __init__(self, flat: torch.Tensor, like: torch.Tensor | None = None):
        S = flat.shape[0]
        if per_head_rows(flat):  # [S, H, ...] over [H, S, ...] storage
            rows = flat.transpose(0, 1).reshape(flat.shape[1], S, math.prod(flat.shape[2:]))
        elif like is not None and per_head_rows(like):  # contiguous [S, H, ...], moved a head at a time
            rows = flat.reshape(S, flat.shape[1], math.prod(flat.shape[2:])).transpose(0, 1)
        else:  # whole slots
            rows = flat.reshape(1, S, math.prod(flat.shape[1:]))
        word = torch.int32 if rows.shape[2] * rows.element_size() % 4 == 0 else torch.uint8  # whole words where it can
        self.words = rows.view(word) if rows.dtype != word else rows
        self.heads, self.E = self.words.shape[0], self.words.shape[2]
        self.head, self.slot = self.words.stride(0), self.words.stride(1)


def _launch_copy(pairs: list[tuple[_Rows, _Rows]], source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                 gather: bool = False, scatter: bool = False, every: bool = False, fill: list[int] | None = None,
                 clear: list[int | None] | None = None) -> None:
    """The copy kernel over ``mask``'s entries for every (source rows, target rows) pair, in one launch
    (``gather``: dense targets, ``scatter``: dense sources; the index tensor of a dense side is not
    read; ``every``: all entries, the mask is not read; ``fill``: per pair, what a gather writes for
    a masked-out entry; ``clear``: per pair, the value its moved-from rows take, or None)."""
    fill = fill or [0] * len(pairs)
    clear = clear or [None] * len(pairs)
    tensors = tuple((src.words, dst.words, src.heads, src.head, src.slot, dst.head, dst.slot, value, emptied or 0)
                    for (src, dst), value, emptied in zip(pairs, fill, clear))
    shapes = tuple((src.E, next_pow2(src.E), emptied is not None) for (src, _), emptied in zip(pairs, clear))
    block = max(1, ELEMENTS // max(E_P for _, E_P, _ in shapes))
    n = mask.numel()
    _copy_kernel[(triton_blocks(n, block), max(src.heads for src, _ in pairs))](
        tensors, source.contiguous(), target.contiguous(), mask.contiguous(), n, SHAPES=shapes, BLOCK=block,
        GATHER=gather, SCATTER=scatter, EVERY=every)


def copy_slots_torch(flat: torch.Tensor, source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                     trash: int, fill: int | None = None) -> None:
    """Reference of :func:`copy_slots` and :func:`move_slots`: every source is read before any target is written."""
    moved = flat.index_select(0, torch.where(mask, source, trash).reshape(-1))
    if fill is None:
        flat.index_copy_(0, torch.where(mask, target, trash).reshape(-1), moved)
        return
    taken = mask.reshape(-1, *[1] * (flat.dim() - 1))
    flat.index_copy_(0, target.reshape(-1), torch.where(taken, moved, torch.full_like(moved, fill)))


def triton_blocks(n: int, block: int) -> int:
    """Programs for ``n`` entries, ``block`` each (at least one)."""
    return max(1, -(-n // block))
