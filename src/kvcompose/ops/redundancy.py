"""R-KV's key redundancy as column sums, without the ``L x L`` similarity matrix.

The ``rkv`` evictor (:mod:`kvcompose.evictors.redundancy`) needs, per sequence ``b``
and KV head ``h``, the column sums of the cosine-similarity matrix of the layer's
keys after two edits: pairs involving an empty slot and the diagonal count 0, and
each row ``i`` zeroes its ``β`` newest (largest position) partners ``j`` with
``sim[i, j] > threshold`` (the spared look-alikes). The evictor divides the sums by
the live count and takes a softmax; see its module doc for why the sparing goes in
that direction.

Written densely (:func:`redundancy_column_sums_torch`, the reference) that is a
``[B, Hkv, L, L]`` fp32 matrix plus a ``topk`` over it: 0.7 GB and several full
passes per layer at Llama-3-8B shapes with 2K candidates. The kernel streams it
instead. One program takes a tile of 128 rows ``i`` of one (b, h), walks the column
tiles of 64 with tensor-core dots and keeps, per row, the running sum over valid
``j != i`` and (β = 1) the largest position among the partners above the threshold
(the diagonal is masked only in the tiles that hold it). Because
``sim`` is symmetric, row ``i``'s sum is also column ``i``'s sum before sparing;
sparing then only takes ``sim[i, j*]`` away from column ``j*`` for each row ``i``
that spares it, which one ``scatter_add`` over ``[B, Hkv, L]`` does. Memory is
linear in ``L``; the work is still quadratic. On an H100 at B=16, Hkv=8, D=128, bf16
(``benchmarks/bench_redundancy_gpu.py``) the dense path took 8 ms at 1,024 candidates
and 29 ms at 2,176 (1.8 and 7.7 GiB of scratch), the kernel path 0.4-0.6 and
0.8-1.1 ms (a few MiB).

Normalization. The keys stay in their own dtype and the kernel multiplies each dot
product by the two inverse norms ``1 / (‖K‖ + 1e-8)``, computed once in fp32 by torch
before the launch (``[B, Hkv, L]``, one read of the keys). A product of two bf16 or
fp16 values is exact in fp32, so a tensor-core dot with fp32 accumulation of the
stored keys is as accurate as the reference's fp32 arithmetic; unit keys rounded
back to bf16 would move similarities by ~1e-3 and flip threshold decisions, and unit
keys in fp32 would need an fp32 dot (no tensor cores, or TF32's 10-bit mantissa).
fp32 keys are dotted with ``input_precision="ieee"``. The two paths therefore agree
to fp32 rounding: column sums within summation-order tolerance, and the same spared
partners except for a pair whose similarity lies within a few ulps of the threshold.

The partner's column and similarity are found after the column loop, not in it: the
loop keeps only the best position and the column tile it came from (one max per
tile row instead of three reductions), and the epilogue finds the column in that
tile by its position and recomputes the similarity from the two keys (equal to the
value the loop compared up to fp32 rounding).

Inputs follow :class:`~kvcompose.evictors.base.EvictionContext`: positions are unique
among a row's valid slots (the store's invariant; with duplicates the two paths may
spare different, equally new, partners). Only partners at positions >= 0 are spared
(a valid slot at a negative position still counts in the sums). The kernel compares
positions as int32, the reference as float32 (exact below 2**24, as before). Keys of
empty slots are never read by the kernel and masked by the reference, so they may
hold anything, NaN included. No host synchronization on the kernel path (CUDA-graph
safe: host-side shape and dtype checks only).
"""

from __future__ import annotations

import math

import torch

from .checks import FLOAT_DTYPES
from .dispatch import step_kernel_runs
from .triton_shim import cdiv, interpreted, jit, next_pow2, tl

EPS = 1e-8  # R-KV Eq. 5's guard against zero-norm keys
BLOCK_ROWS = 128  # rows i per program; a multiple of BLOCK_COLS (see _launch_shape)
BLOCK_COLS = 64  # columns j per tile of the loop
WARPS = 4
MAX_KERNEL_HEAD_DIM = 256  # larger head dims use the reference unless the kernel is forced
KEY_DTYPES = (*FLOAT_DTYPES, torch.float64)
INT32_MAX = 2**31 - 1


@jit
def _column_tile(ki, ri, rows, row_sum, best_pos, best_tile, k_row_ptr, r_row_ptr, pos_row_ptr, j0, L,
                 stride_kl, threshold, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
                 BETA: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """One ``[BM, BN]`` tile of similarities: add it to the row sums and (BETA) update each
    row's newest similar partner. ``DIAG``: the tile holding ``i == j``, which counts 0."""
    cols = j0 + tl.arange(0, BN)
    d = tl.arange(0, DP)
    pos_j = tl.load(pos_row_ptr + cols, mask=cols < L, other=-2)  # -2: an empty slot (set by the wrapper)
    live_j = pos_j >= -1
    kj = tl.load(k_row_ptr + cols[:, None] * stride_kl + d[None, :], mask=live_j[:, None] & (d[None, :] < D),
                 other=0.0)
    if not NATIVE:  # the interpreter: bf16 dots are unreliable there; fp32 holds the values exactly
        kj = kj.to(tl.float32)
    rj = tl.load(r_row_ptr + cols, mask=live_j, other=0.0)
    # Empty rows and columns were loaded as zero keys with zero inverse norms: their entries are exactly 0.
    s = tl.dot(ki, tl.trans(kj), input_precision=PREC) * ri[:, None] * rj[None, :]
    if DIAG:
        s = tl.where(rows[:, None] == cols[None, :], 0.0, s)
    row_sum += tl.sum(s, 1)
    if BETA:
        similar = s > threshold
        if DIAG:
            similar = similar & (rows[:, None] != cols[None, :])
        newest = tl.max(tl.where(similar, pos_j[None, :], -1), 1)  # -1 or -2 never beats the initial -1
        better = newest > best_pos
        best_pos = tl.where(better, newest, best_pos)
        best_tile = tl.where(better, j0, best_tile)
    return row_sum, best_pos, best_tile


@jit
def _redundancy_kernel(k_ptr, r_ptr, pos_ptr, row_sum_ptr, col_ptr, sim_ptr, L, H, tiles, stride_kb, stride_kh,
                       stride_kl, threshold, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BETA: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr):
    # One program per (b, h, tile of BM rows); tiles of one (b, h) are adjacent, so its keys stay in L2.
    pid = tl.program_id(0)
    bh = (pid // tiles).to(tl.int64)
    i0 = (pid % tiles) * BM
    b = bh // H
    h = bh % H
    k_row_ptr = k_ptr + b * stride_kb + h * stride_kh
    r_row_ptr = r_ptr + bh * L
    pos_row_ptr = pos_ptr + b * L
    rows = i0 + tl.arange(0, BM)
    d = tl.arange(0, DP)
    in_i = rows < L
    live_i = tl.load(pos_row_ptr + rows, mask=in_i, other=-2) >= -1
    ki = tl.load(k_row_ptr + rows[:, None] * stride_kl + d[None, :], mask=live_i[:, None] & (d[None, :] < D),
                 other=0.0)
    if not NATIVE:
        ki = ki.to(tl.float32)
    ri = tl.load(r_row_ptr + rows, mask=live_i, other=0.0)
    row_sum = tl.zeros([BM], dtype=tl.float32)
    best_pos = tl.full([BM], -1, dtype=tl.int32)
    best_tile = tl.zeros([BM], dtype=tl.int32)
    # Column tiles before the rows' own, the BM // BN tiles that hold the diagonal, the tiles after.
    for j0 in range(0, i0, BN):
        row_sum, best_pos, best_tile = _column_tile(
            ki, ri, rows, row_sum, best_pos, best_tile, k_row_ptr, r_row_ptr, pos_row_ptr, j0, L, stride_kl,
            threshold, D, DP, BN, BETA, False, PREC, NATIVE)
    for j0 in range(i0, tl.minimum(i0 + BM, L), BN):
        row_sum, best_pos, best_tile = _column_tile(
            ki, ri, rows, row_sum, best_pos, best_tile, k_row_ptr, r_row_ptr, pos_row_ptr, j0, L, stride_kl,
            threshold, D, DP, BN, BETA, True, PREC, NATIVE)
    for j0 in range(i0 + BM, L, BN):
        row_sum, best_pos, best_tile = _column_tile(
            ki, ri, rows, row_sum, best_pos, best_tile, k_row_ptr, r_row_ptr, pos_row_ptr, j0, L, stride_kl,
            threshold, D, DP, BN, BETA, False, PREC, NATIVE)
    out = bh * L + rows
    tl.store(row_sum_ptr + out, row_sum, mask=in_i)
    if BETA:
        # The partner's column: the one in its tile holding the best position (positions are unique).
        spares = live_i & (best_pos >= 0)
        cols = best_tile[:, None] + tl.arange(0, BN)[None, :]
        found = spares[:, None] & (cols < L)
        pos_c = tl.load(pos_row_ptr + cols, mask=found, other=-1)
        col = tl.max(tl.where(found & (pos_c == best_pos[:, None]), cols, -1), 1)
        spares = spares & (col >= 0)
        # Its similarity, recomputed from the two keys (fp32 rounding apart, the value the loop compared).
        kc = tl.load(k_row_ptr + col[:, None] * stride_kl + d[None, :], mask=spares[:, None] & (d[None, :] < D),
                     other=0.0)
        rc = tl.load(r_row_ptr + col, mask=spares, other=0.0)
        sim = tl.sum(ki.to(tl.float32) * kc.to(tl.float32), 1) * ri * rc
        tl.store(col_ptr + out, tl.where(spares, col, -1).to(tl.int64), mask=in_i)
        tl.store(sim_ptr + out, tl.where(spares, sim, 0.0), mask=in_i)


def _check(keys, valid, positions, threshold, beta) -> None:
    name = "redundancy_column_sums"
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"{name}: keys must be a tensor [B, Hkv, L, D], got {shape}")
    if keys.dtype not in KEY_DTYPES:
        accepted = ", ".join(str(t) for t in KEY_DTYPES)
        raise ValueError(f"{name}: keys have dtype {keys.dtype}; accepted: {accepted}")
    B, _, L, D = keys.shape
    if D == 0:
        raise ValueError(f"{name}: keys have head dim 0")
    for what, t in (("valid", valid), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, L):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what} must be [B, L] = {[B, L]} for keys {tuple(keys.shape)}, got {shape}")
        if t.device != keys.device:
            raise ValueError(f"{name}: {what} is on {t.device}, keys on {keys.device}")
    if valid.dtype != torch.bool:
        raise ValueError(f"{name}: valid must be torch.bool, got {valid.dtype}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"{name}: positions must be an integer tensor, got {positions.dtype}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"{name}: threshold must be a real number (a Python float, not NaN), got {threshold!r}")
    if isinstance(beta, bool) or not isinstance(beta, int) or beta < 0:
        raise ValueError(f"{name}: beta (spared partners per token) must be an int >= 0, got {beta!r}")


def redundancy_column_sums(keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, threshold: float,
                           beta: int, backend: str | None = None) -> torch.Tensor:
    """Column sums of R-KV's edited key-similarity matrix, ``[B, Hkv, L]`` fp32 (0 on empty slots).

    ``keys`` ``[B, Hkv, L, D]`` (float16, bfloat16, float32; float64 runs the reference),
    ``valid`` ``[B, L]`` bool, ``positions`` ``[B, L]`` integer, unique among each row's
    valid slots. ``sim[i, j]`` is the cosine similarity of the keys with the
    ``1e-8`` norm guard; pairs with an empty slot and ``i == j`` count 0, and each row ``i``
    zeroes the ``beta`` partners of largest position with ``sim[i, j] > threshold``. Returns
    ``Σ_i sim[i, j]``; divide by the live count for R-KV's mean similarity.

    ``backend``: None runs the kernel on CUDA (head dim up to 256) and the reference
    elsewhere; ``"triton"`` forces the kernel (CUDA, or the interpreter under
    ``TRITON_INTERPRET=1``); ``"torch"`` the reference. The kernel spares at most one
    partner per token, so ``beta > 1`` always runs the reference.
    """
    _check(keys, valid, positions, threshold, beta)
    B, H, L, D = keys.shape
    fits = keys.dtype in FLOAT_DTYPES and D <= MAX_KERNEL_HEAD_DIM
    runs = step_kernel_runs(keys, _redundancy_kernel, backend, fits)
    if runs and keys.dtype not in FLOAT_DTYPES and beta <= 1:
        raise ValueError(f"redundancy_column_sums: the kernel reads float16/bfloat16/float32 keys, got {keys.dtype}; "
                         f"use backend=None or 'torch'")
    if not runs or beta > 1:
        return redundancy_column_sums_torch(keys, valid, positions, threshold, beta)
    return _column_sums_triton(keys, valid, positions, float(threshold), beta)


def _column_sums_triton(keys, valid, positions, threshold: float, beta: int) -> torch.Tensor:
    row_sum, spared_col, spared_sim = _kernel_outputs(keys, valid, positions, threshold, beta)
    if not beta:
        return row_sum
    # Row i's sum is column i's before sparing (sim is symmetric); a spared pair leaves column j*.
    return row_sum.scatter_add_(-1, spared_col.clamp(min=0), spared_sim.neg())


def _launch_shape(L: int) -> tuple[int, int]:
    """(rows per program, columns per tile): the module's tile, narrowed for short rows (the dot needs 16)."""
    bn = min(BLOCK_COLS, max(16, next_pow2(L)))
    bm = max(bn, min(BLOCK_ROWS, next_pow2(L)))
    return bm, bn


def _kernel_outputs(keys, valid, positions, threshold: float, beta: int):
    """The kernel's three ``[B, Hkv, L]`` results: the row sums over valid ``j != i``, and (β = 1)
    the spared partner's column (-1: none) and its similarity (0: none); None for β = 0."""
    B, H, L, D = keys.shape
    device = keys.device
    row_sum = torch.empty(B, H, L, dtype=torch.float32, device=device)  # the kernel writes every entry
    spared_col = torch.empty(B, H, L, dtype=torch.int64, device=device) if beta else None
    spared_sim = torch.empty(B, H, L, dtype=torch.float32, device=device) if beta else None
    if B * H * L == 0:
        return row_sum, spared_col, spared_sim
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    norm = torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    inv_norm = torch.where(valid[:, None, :], 1.0 / (norm + EPS), 0.0).contiguous()
    # Positions as int32 and the kernel's one source of slot validity: -2 on empty slots. A valid negative
    # position becomes -1, which is never spared (the reference's rule: only positions >= 0 are).
    pos = torch.where(valid, positions.clamp(-1, INT32_MAX), -2).to(torch.int32).contiguous()
    bm, bn = _launch_shape(L)
    tiles = cdiv(L, bm)
    native = not interpreted(_redundancy_kernel)
    _redundancy_kernel[(B * H * tiles,)](
        keys, inv_norm, pos, row_sum, row_sum if spared_col is None else spared_col,
        row_sum if spared_sim is None else spared_sim, L, H, tiles, keys.stride(0), keys.stride(1), keys.stride(2),
        threshold, D=D, DP=next_pow2(max(D, 16)), BM=bm, BN=bn, BETA=beta == 1,
        PREC="ieee" if keys.dtype == torch.float32 or not native else "tf32", NATIVE=native, num_warps=WARPS,
    )
    return row_sum, spared_col, spared_sim


def redundancy_column_sums_torch(keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, threshold: float,
                                 beta: int) -> torch.Tensor:
    """Reference of :func:`redundancy_column_sums`: the dense ``[B, Hkv, L, L]`` similarity
    matrix and a ``topk`` over partner positions (the ``rkv`` evictor's original code)."""
    keys = keys.float()
    unit = keys / (keys.norm(dim=-1, keepdim=True) + EPS)
    sim = unit @ unit.transpose(-1, -2)  # [B, Hkv, L, L]; sim[..., i, j]
    L = sim.shape[-1]
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    pair = pair & ~torch.eye(L, dtype=torch.bool, device=sim.device)
    sim = sim.masked_fill(~pair, 0.0)
    beta = min(beta, L)
    if beta > 0:
        # Position of every similar partner j of i (-1 otherwise); the top β are i's newest look-alikes.
        # float32 positions are exact below 2**24 and take half the memory of int64.
        pos = positions.to(torch.float32)[:, None, None, :]
        similar_pos = torch.where(pair & (sim > threshold), pos, torch.full_like(pos, -1.0))
        newest = similar_pos.topk(beta, dim=-1)
        spared = torch.zeros_like(sim, dtype=torch.bool).scatter_(-1, newest.indices, newest.values >= 0)
        sim = sim.masked_fill(spared, 0.0)
    return sim.sum(dim=-2)  # column sums: how much each j repeats the others
