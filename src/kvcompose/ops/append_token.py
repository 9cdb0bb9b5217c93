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

from ..rotations.base import SignedProduct, rotate
from .dispatch import step_kernel_runs
from .layout import OUT_KINDS, store_out_tl
from .rotate_rows import MATRIX_BYTES, signed_product_tl
from .triton_shim import interpreted, jit, next_pow2, tl

FIXED_CHANNELS = ("pos", "valid", "cls")  # written by the kernel; other (float) channels get 0


@jit
def _rotated_rows(x_ptr, sb, sh, sd, b, sign_ptr, m, ROWS: tl.constexpr, RP: tl.constexpr, GROUP: tl.constexpr,
                  D: tl.constexpr, SIGNS_FIRST: tl.constexpr, LOW: tl.constexpr):
    """Row ``b``'s ``ROWS`` heads of ``x`` (padded to ``RP``), each times its KV head's signed
    matrix (head ``r // GROUP``): ``[RP, D]`` in fp32."""
    r = tl.arange(0, RP)
    d = tl.arange(0, D)
    inside = (r < ROWS)[:, None]
    x = tl.load(x_ptr + b * sb + r[:, None] * sh + d[None, :] * sd, mask=inside, other=0.0).to(tl.float32)
    signs = tl.load(sign_ptr + (r // GROUP)[:, None] * D + d[None, :], mask=inside, other=0.0).to(tl.float32)
    return signed_product_tl(x, signs, m, SIGNS_FIRST, LOW)


@jit
def _non_finite(x):
    """Whether any entry of the fp32 tile ``x`` ``[R, D]`` is NaN or infinite (0 or 1, int32)."""
    return tl.max(tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), 1), 0)


@jit
def _append_token_kernel(k_ptr, v_ptr, ksb, ksh, ksd, vsb, vsh, vsd, bk_ptr, bv_ptr, len_ptr, seen_ptr,
                         column_ptr, positions_ptr, cls_in_ptr, bpos_ptr, bvalid_ptr, bcls_ptr,
                         overflow_ptr, nonfinite_ptr, zero_ptr, q_ptr, qsb, qsh, qsd, ring_q_ptr, ring_pos_ptr,
                         sign_ptr, m_ptr, q_out_ptr,
                         CAP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, HD_P: tl.constexpr, ZERO: tl.constexpr,
                         RING: tl.constexpr, W: tl.constexpr, HQ: tl.constexpr, QD_P: tl.constexpr,
                         ROT: tl.constexpr, HP: tl.constexpr, QP: tl.constexpr, OUT: tl.constexpr,
                         SIGNS_FIRST: tl.constexpr, LOW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + b)
    at = tl.minimum(n, CAP - 1)
    tl.atomic_or(overflow_ptr, 1, mask=n >= CAP)
    row_slot = b * CAP + at
    column = tl.load(column_ptr + b)
    if ROT:  # the rotation of the step's keys, values and queries, as tiles of heads on the tensor cores
        d = tl.arange(0, D)
        m = tl.load(m_ptr + d[:, None] * D + d[None, :])
        r = tl.arange(0, HP)
        inside = (r < H)[:, None]
        k = _rotated_rows(k_ptr, ksb, ksh, ksd, b, sign_ptr, m, H, HP, 1, D, SIGNS_FIRST, LOW)
        v = _rotated_rows(v_ptr, vsb, vsh, vsd, b, sign_ptr, m, H, HP, 1, D, SIGNS_FIRST, LOW)
        tl.atomic_or(nonfinite_ptr, 1, mask=(_non_finite(k) + _non_finite(v)) > 0)
        store_out_tl(bk_ptr + row_slot * (H * D) + r[:, None] * D + d[None, :], k, inside, OUT)
        store_out_tl(bv_ptr + row_slot * (H * D) + r[:, None] * D + d[None, :], v, inside, OUT)
        rq = tl.arange(0, QP)
        q = _rotated_rows(q_ptr, qsb, qsh, qsd, b, sign_ptr, m, HQ, QP, HQ // H, D, SIGNS_FIRST, LOW)
        store_out_tl(q_out_ptr + (b * HQ + rq[:, None]) * D + d[None, :], q, (rq < HQ)[:, None], OUT)
        if RING:
            store_out_tl(ring_q_ptr + ((b * HQ + rq[:, None]) * W + column % W) * D + d[None, :], q,
                         (rq < HQ)[:, None], OUT)
    else:
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
        tl.store(bk_ptr + row_slot * (H * D) + e, k, mask=m)
        tl.store(bv_ptr + row_slot * (H * D) + e, v, mask=m)
        if RING:  # the step's query [HQ, D] to its ring slot
            f = tl.arange(0, QD_P)
            mq = f < HQ * D
            hq = f // D
            dq = f % D
            q = tl.load(q_ptr + b * qsb + hq * qsh + dq * qsd, mask=mq, other=0.0)
            tl.store(ring_q_ptr + ((b * HQ + hq) * W + column % W) * D + dq, q, mask=mq)
    tl.store(column_ptr + b, column + 1)  # each row its own counter: no other program reads it
    tl.store(positions_ptr + b, column)
    tl.store(bpos_ptr + row_slot, column)
    tl.store(bvalid_ptr + row_slot, 1)
    tl.store(bcls_ptr + row_slot, tl.load(cls_in_ptr + b))
    if ZERO:  # a float slot channel (h2o's attention mass) starts at 0
        tl.store(zero_ptr + row_slot, 0.0)
    tl.store(len_ptr + b, n + 1)
    tl.store(seen_ptr + b, tl.load(seen_ptr + b) + 1)
    if RING:
        tl.store(ring_pos_ptr + b * W + column % W, column)


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
                 backend: str | None = None, rotation: SignedProduct | torch.Tensor | None = None,
                 query: torch.Tensor | None = None):
    """Append ``keys`` / ``values`` ``[B, H, 1, D]`` at each row's next slot of the buffer
    ``buf_k`` / ``buf_v`` ``[B, cap, H, D]`` (the last slot when full, which sets ``overflow``),
    with position ``column`` (``[B]``: each row's next column, advanced by one in the same
    launch; the rows' counters are equal in static mode), class ``cls`` ``[B]`` and the
    live bit in ``meta``'s channels (other channels get 0); ``buf_len`` and ``tokens_seen``
    move on by one; a non-finite key or value sets ``nonfinite``. Returns the positions
    ``[B, 1]``. ``ring``: ``(query [B, Hq, 1, D], queries [B, Hq, W, D], positions [B, W])``,
    a ring of recent queries whose slot ``column % W`` takes the step's query and its
    position. Everything stays on the device. ``backend`` as the other per-step ops
    (:func:`~kvcompose.ops.dispatch.step_kernel_runs`).

    ``rotation`` (a store that keeps its keys and values rotated, :mod:`kvcompose.rotations`):
    the keys, the values and ``query`` ``[B, Hq, 1, D]`` are rotated first (each head by its KV
    head's matrix, as :func:`~kvcompose.rotations.rotate` does), and the call returns
    ``(positions, rotated query)``; the ring, if any, takes the rotated query. A
    :class:`~kvcompose.rotations.SignedProduct` (Hadamard) is applied in the same launch;
    other matrices, and the torch path, rotate before appending."""
    _check(keys, values, buf_k, buf_v, meta, column, cls, ring)
    if rotation is not None:
        if query is None or query.dim() != 4 or query.shape[0] != keys.shape[0] or query.shape[2:] != keys.shape[2:]:
            raise ValueError(f"append_token: a rotation needs the step's query [{keys.shape[0]}, Hq, 1, "
                             f"{keys.shape[-1]}]; got {None if query is None else tuple(query.shape)}")
        if not (rotation_folds(keys, query, rotation) and step_kernel_runs(keys, _append_token_kernel, backend)):
            query, keys, values = (rotate(t, rotation) for t in (query, keys, values))
            ring = None if ring is None else (query, *ring[1:])
            return append_token(keys, values, buf_k, buf_v, meta, buf_len, tokens_seen, column, cls, overflow,
                                nonfinite, ring, backend), query
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
    ring_args, ring_consts = _ring_launch(ring, keys, query if rotation is not None else None)
    rot_args, rot_consts, q_out = _rotation_launch(rotation, keys, query)
    bits = (lambda t: t.view(torch.int16)) if rotation is not None and keys.dtype == torch.bfloat16 else (lambda t: t)
    _append_token_kernel[(B,)](
        keys, values, keys.stride(0), keys.stride(1), keys.stride(3), values.stride(0), values.stride(1),
        values.stride(3), bits(buf_k), bits(buf_v), buf_len, tokens_seen, column, positions, cls, meta["pos"],
        meta["valid"].view(torch.uint8), meta["cls"], overflow, nonfinite, extra[0] if extra else keys, *ring_args,
        *rot_args, CAP=cap, H=H, D=D, HD_P=next_pow2(H * D), ZERO=bool(extra), **ring_consts, **rot_consts,
        num_warps=4)
    return positions if rotation is None else (positions, q_out)


def rotation_folds(keys: torch.Tensor, query: torch.Tensor, rotation) -> bool:
    """Whether the kernel applies ``rotation`` itself: a signed shared matrix (Hadamard) of a
    power-of-two head dim of at least 16 that fits :data:`~kvcompose.ops.rotate_rows.MATRIX_BYTES`,
    in a dtype the kernel writes, with as many sign rows as KV heads."""
    D = keys.shape[-1]
    size = D * D * (4 if keys.dtype == torch.float32 else 2)
    return (isinstance(rotation, SignedProduct) and D == next_pow2(D) and D >= 16 and size <= MATRIX_BYTES
            and keys.dtype in OUT_KINDS and query.dtype == keys.dtype and rotation.signs.shape[0] == keys.shape[1]
            and query.shape[1] % keys.shape[1] == 0)


def _rotation_launch(rotation, keys, query) -> tuple[tuple, dict, torch.Tensor | None]:
    """The kernel's rotation arguments and constants, and the rotated query it writes (the keys
    stand in for unused pointers)."""
    if rotation is None:
        return (keys, keys, keys), dict(ROT=False, HP=1, QP=1, OUT=0, SIGNS_FIRST=False, LOW=False), None
    kind = OUT_KINDS[keys.dtype]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    signs, matrix = rotation.signs.to(keys.dtype).contiguous(), rotation.matrix.to(keys.dtype).contiguous()
    consts = dict(ROT=True, HP=max(16, next_pow2(keys.shape[1])), QP=max(16, next_pow2(query.shape[1])), OUT=kind,
                  SIGNS_FIRST=rotation.signs_first, LOW=kind != 0 and not interpreted(_append_token_kernel))
    return (signs, matrix, q_out.view(torch.int16) if kind == 1 else q_out), consts, q_out


def _ring_launch(ring, keys, rotated_query=None) -> tuple[tuple, dict]:
    """The kernel's query arguments and constants: the ring's, and with a rotation the query the
    kernel rotates (the ring then takes rotated rows, written as bf16 bits like every rotated
    output); the keys stand in for unused pointers."""
    if ring is None and rotated_query is None:
        return (keys, 0, 0, 0, keys, keys), dict(RING=False, W=1, HQ=1, QD_P=1)
    query = ring[0] if rotated_query is None else rotated_query
    Hq, D = query.shape[1], query.shape[3]
    queries = (query, query.stride(0), query.stride(1), query.stride(3))
    if ring is None:
        return (*queries, keys, keys), dict(RING=False, W=1, HQ=Hq, QD_P=next_pow2(Hq * D))
    _, ring_q, ring_pos = ring
    if rotated_query is not None and ring_q.dtype == torch.bfloat16:
        ring_q = ring_q.view(torch.int16)
    return (*queries, ring_q, ring_pos), dict(RING=True, W=ring_q.shape[2], HQ=Hq, QD_P=next_pow2(Hq * D))


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
