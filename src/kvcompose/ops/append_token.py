"""Append one decode step's token per row to a store's recent buffer, in one launch.

The static decode path appends every layer's new key and value each step: the token goes
to its row's next buffer slot with its position, class and live bit; the row's buffer
length and token count move on; a full buffer (the schedule should have flushed it) and
a non-finite key or value raise device flags that the host reads at its next
synchronization. Policies whose evictor scores with recent queries also keep the step's
query: it goes to slot ``column % W`` of a ring of ``W`` queries (no shift of the whole
window per step). Written with torch ops that is about 25 small kernels per layer and
step (800 per step of a 32-layer model), each costing a few microseconds even inside a
CUDA graph; :func:`append_token` does it in one program per row.

:func:`append_token_torch` is the plain-torch reference (and the CPU path).
"""

from __future__ import annotations

import torch

from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl

FIXED_CHANNELS = ("pos", "valid", "cls")  # written by the kernel; other (float) channels get 0


@jit
def _append_token_kernel(k_ptr, v_ptr, ksb, ksh, ksd, vsb, vsh, vsd, bk_ptr, bv_ptr, len_ptr, seen_ptr,
                         column_ptr, positions_ptr, cls_in_ptr, bpos_ptr, bvalid_ptr, bcls_ptr,
                         overflow_ptr, nonfinite_ptr, zero_ptr, q_ptr, qsb, qsh, qsd, ring_q_ptr, ring_pos_ptr,
                         CAP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, HD_P: tl.constexpr, ZERO: tl.constexpr,
                         RING: tl.constexpr, W: tl.constexpr, HQ: tl.constexpr, QD_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + b)
    at = tl.minimum(n, CAP - 1)
    tl.atomic_or(overflow_ptr, 1, mask=n >= CAP)
    e = tl.arange(0, HD_P)
    m = e < H * D
    h = e // D
    d = e % D
    k = tl.load(k_ptr + b * ksb + h * ksh + d * ksd, mask=m, other=0.0)
    v = tl.load(v_ptr + b * vsb + h * vsh + d * vsd, mask=m, other=0.0)
    kf = k.to(tl.float32)
    vf = v.to(tl.float32)
    bad = (kf != kf) | (tl.abs(kf) == float("inf")) | (vf != vf) | (tl.abs(vf) == float("inf"))
    tl.atomic_or(nonfinite_ptr, 1, mask=tl.max(bad.to(tl.int32), 0) > 0)
    row_slot = b * CAP + at
    tl.store(bk_ptr + row_slot * (H * D) + e, k, mask=m)
    tl.store(bv_ptr + row_slot * (H * D) + e, v, mask=m)
    column = tl.load(column_ptr + b)
    tl.store(column_ptr + b, column + 1)  # each row its own counter: no other program reads it
    tl.store(positions_ptr + b, column)
    tl.store(bpos_ptr + row_slot, column)
    tl.store(bvalid_ptr + row_slot, 1)
    tl.store(bcls_ptr + row_slot, tl.load(cls_in_ptr + b))
    if ZERO:  # a float slot channel (h2o's attention mass) starts at 0
        tl.store(zero_ptr + row_slot, 0.0)
    tl.store(len_ptr + b, n + 1)
    tl.store(seen_ptr + b, tl.load(seen_ptr + b) + 1)
    if RING:  # the step's query [HQ, D] to its ring slot
        slot = column % W
        f = tl.arange(0, QD_P)
        mq = f < HQ * D
        hq = f // D
        dq = f % D
        q = tl.load(q_ptr + b * qsb + hq * qsh + dq * qsd, mask=mq, other=0.0)
        tl.store(ring_q_ptr + ((b * HQ + hq) * W + slot) * D + dq, q, mask=mq)
        tl.store(ring_pos_ptr + b * W + slot, column)


def _check(keys, values, buf_k, buf_v, meta, column, cls, ring) -> None:
    B, cap, H, D = buf_k.shape
    if tuple(column.shape) != (B,) or column.dtype != torch.long or not column.is_contiguous():
        raise ValueError(f"append_token: column of shape {tuple(column.shape)} and dtype {column.dtype}; expected a "
                         f"contiguous int64 [{B}] tensor (each row's next column)")
    for name, x, buf in (("keys", keys, buf_k), ("values", values, buf_v)):
        if tuple(x.shape) != (B, H, 1, D) or x.dtype != buf.dtype:
            raise ValueError(f"append_token: {name} of shape {tuple(x.shape)} and dtype {x.dtype}; the buffer takes "
                             f"[{B}, {H}, 1, {D}] in {buf.dtype}")
    missing = [c for c in FIXED_CHANNELS if c not in meta]
    if missing:
        raise ValueError(f"append_token: buffer metadata lacks {missing}; it must hold {list(FIXED_CHANNELS)}")
    if not (buf_k.is_contiguous() and buf_v.is_contiguous()):
        raise ValueError("append_token: the buffers must be contiguous [B, cap, H, D] tensors")
    for name, t in meta.items():
        if tuple(t.shape) != (B, cap) or not t.is_contiguous():
            raise ValueError(f"append_token: metadata channel {name!r} of shape {tuple(t.shape)}; every channel must "
                             f"be a contiguous [{B}, {cap}] tensor")
    if tuple(cls.shape) != (B,):
        raise ValueError(f"append_token: classes of shape {tuple(cls.shape)}; expected [{B}]")
    if ring is not None:
        query, ring_q, ring_pos = ring
        Hq, W = ring_q.shape[1], ring_q.shape[2]
        if query.dim() != 4 or tuple(query.shape) != (B, Hq, 1, D) or query.dtype != ring_q.dtype:
            raise ValueError(f"append_token: query of shape {tuple(query.shape)} and dtype {query.dtype}; the ring "
                             f"takes [{B}, {Hq}, 1, {D}] in {ring_q.dtype}")
        if tuple(ring_q.shape) != (B, Hq, W, D) or not ring_q.is_contiguous():
            raise ValueError(f"append_token: the query ring must be a contiguous [{B}, Hq, W, {D}] tensor, got "
                             f"{tuple(ring_q.shape)}")
        if tuple(ring_pos.shape) != (B, W) or ring_pos.dtype != torch.long or not ring_pos.is_contiguous():
            raise ValueError(f"append_token: ring positions must be a contiguous int64 [{B}, {W}] tensor, got "
                             f"{tuple(ring_pos.shape)} {ring_pos.dtype}")


def append_token(keys: torch.Tensor, values: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                 meta: dict[str, torch.Tensor], buf_len: torch.Tensor, tokens_seen: torch.Tensor,
                 column: torch.Tensor, cls: torch.Tensor, overflow: torch.Tensor, nonfinite: torch.Tensor,
                 ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """Append ``keys`` / ``values`` ``[B, H, 1, D]`` at each row's next slot of the buffer
    ``buf_k`` / ``buf_v`` ``[B, cap, H, D]`` (the last slot when full, which sets ``overflow``),
    with position ``column`` (``[B]``: each row's next column, advanced by one in the same
    launch; the rows' counters are equal in static mode), class ``cls`` ``[B]`` and the
    live bit in ``meta``'s channels (other channels get 0); ``buf_len`` and ``tokens_seen``
    move on by one; a non-finite key or value sets ``nonfinite``. Returns the positions
    ``[B, 1]``. ``ring``: ``(query [B, Hq, 1, D], queries [B, Hq, W, D], positions [B, W])``,
    a ring of recent queries whose slot ``column % W`` takes the step's query and its
    position. Everything stays on the device. ``backend`` as the other per-step ops
    (:func:`~kvcompose.ops.dispatch.step_kernel_runs`)."""
    _check(keys, values, buf_k, buf_v, meta, column, cls, ring)
    if not step_kernel_runs(keys, _append_token_kernel, backend):
        return append_token_torch(keys, values, buf_k, buf_v, meta, buf_len, tokens_seen, column, cls, overflow,
                                  nonfinite, ring)
    B, cap, H, D = buf_k.shape
    positions = torch.empty(B, 1, dtype=torch.long, device=keys.device)
    cls = cls.contiguous()  # the kernel reads one class per row at unit stride
    # float slot channels (h2o's mass) get 0 at the slot the kernel writes: the first in the kernel,
    # any others by a scalar fill (`t[rows, at] = 0` copies a host tensor, which graph capture refuses)
    extra = [t for name, t in meta.items() if name not in FIXED_CHANNELS]
    if len(extra) > 1:
        at = buf_len.clamp(max=cap - 1)[:, None]
        for t in extra[1:]:
            t.scatter_(1, at, 0.0)
    ring_args, ring_consts = _ring_launch(ring, keys)
    _append_token_kernel[(B,)](
        keys, values, keys.stride(0), keys.stride(1), keys.stride(3), values.stride(0), values.stride(1),
        values.stride(3), buf_k, buf_v, buf_len, tokens_seen, column, positions, cls, meta["pos"],
        meta["valid"].view(torch.uint8), meta["cls"], overflow, nonfinite, extra[0] if extra else keys, *ring_args,
        CAP=cap, H=H, D=D, HD_P=next_pow2(H * D), ZERO=bool(extra), **ring_consts, num_warps=4)
    return positions


def _ring_launch(ring, keys) -> tuple[tuple, dict]:
    """The kernel's query-ring arguments and constants (the keys stand in for unused pointers)."""
    if ring is None:
        return (keys, 0, 0, 0, keys, keys), dict(RING=False, W=1, HQ=1, QD_P=1)
    query, ring_q, ring_pos = ring
    _, Hq, W, D = ring_q.shape
    args = (query, query.stride(0), query.stride(1), query.stride(3), ring_q, ring_pos)
    return args, dict(RING=True, W=W, HQ=Hq, QD_P=next_pow2(Hq * D))


def append_token_torch(keys, values, buf_k, buf_v, meta, buf_len, tokens_seen, column, cls, overflow,
                       nonfinite, ring=None) -> torch.Tensor:
    """Reference of :func:`append_token` in torch ops (the ring slot is row 0's column: every
    row's is the same in static mode, where the ring is written)."""
    B, cap = buf_k.shape[:2]
    rows = torch.arange(B, device=keys.device)
    at = buf_len.clamp(max=cap - 1)
    overflow |= (buf_len >= cap).any().to(overflow.dtype)
    finite = torch.isfinite(keys).all() & torch.isfinite(values).all()
    nonfinite |= (~finite).to(nonfinite.dtype)
    positions = column.view(B, 1).clone()  # not a view: the counters move on below
    buf_k[rows, at] = keys[:, :, 0]
    buf_v[rows, at] = values[:, :, 0]
    new = {"pos": positions[:, 0], "cls": cls}
    for name, t in meta.items():  # tensor values only: a Python scalar would be a host copy
        t[rows, at] = new[name] if name in new else torch.full_like(t[:, 0], name == "valid")
    if ring is not None:
        query, ring_q, ring_pos = ring
        slot = column[:1] % ring_q.shape[2]  # one slot for every row: their columns are equal
        ring_q.index_copy_(2, slot, query)
        ring_pos.index_copy_(1, slot, positions)
    buf_len += 1
    tokens_seen += 1
    column += 1
    return positions
