"""Batched K-means token selection: the step-down of ThinKV's TBE eviction.

When ThinKV demotes a thought segment (§3.3.2, appendix D.4), it clusters the
segment's post-RoPE keys into ``K = min(|segment|, R_n)`` groups and keeps, for each
cluster, the token that represents it: "each cluster is replaced by its centroid
key, and the corresponding value entry is retained". A centroid is an average, not
a token, so we keep the real token nearest to each centroid.

Which keys, which distance. The paper clusters "post-RoPE key embeddings" and does
not say how the KV heads of a layer combine or which metric K-means uses. Its eviction
state is one mask per (request, layer) block table, shared by all KV heads (also our
store's rule), so a segment must yield one token set per layer. We therefore treat a
token's keys of all KV heads, concatenated, as its feature vector (``F = Hkv * D``)
and use squared Euclidean distance, the standard K-means objective (also the CUDA
K-means ThinKV cites, Kruliš & Kratochvíl 2020). On concatenated keys that distance
is the sum of the per-head squared distances, so every head has a say. Callers with
keys ``[S, N, Hkv, D]`` pass ``keys.reshape(S, N, Hkv * D)``.

The algorithm, per segment ``s`` with ``K = min(k[s], live[s])`` (clamped to ``max_k``):

1. Seeds (deterministic farthest-first traversal): the first live token by position,
   then repeatedly the live token farthest from all seeds chosen so far (ties go to
   the earlier position). Unlike evenly spaced positions, this puts one seed in each
   of K well-separated clusters, so K-means cannot start with two seeds in one
   cluster and none in another.
2. ``iters`` Lloyd rounds, fixed (no convergence test, so no host synchronisation):
   assign each live token to its nearest centroid (ties to the lower centroid
   index), move each centroid to the mean of its tokens; a centroid left without
   tokens stays where it was.
3. Selection, centroid by centroid in seed order: each centroid keeps its nearest
   live token not kept yet. Two centroids that share a nearest token therefore keep
   that token and the later one's next-nearest, so exactly ``K`` distinct live tokens
   are kept. ``k >= live`` keeps every live token; dead tokens are never kept.
   Distances within ``TIE_REL * (max |c|^2 + max |x|^2)`` of the nearest count as ties
   and go to the earliest position. The tolerance is the fp32 rounding scale of the
   expanded distance; it matters because a centroid of a two-token cluster sits
   midway between them, an exact tie that rounding would break differently in
   each backend.

Arithmetic. Everything after one pass over the keys works on the segment's Gram
matrix ``G = X X^T`` (fp32, ``N x N``): a centroid is a weighted mean of tokens,
``c = sum_i w_i x_i``, so ``x_j . c = (G w)_j`` and ``|c|^2 = w . G w``, and the
squared distance is ``|x|^2 - 2 x.c + |c|^2`` (the argmin over centroids drops
``|x|^2``). This is exactly Euclidean K-means, but a round costs ``O(N^2 K)`` instead
of ``O(N K F)`` and never re-reads the keys (F = 1024 for 8 heads of 128 dims). The
Triton kernel runs one program per segment for all three steps (Gram matrix, token
weights and final distances in fp32 scratch); half-precision keys on GPU form the
Gram matrix on tensor cores, whose products are exact in fp32. The torch reference
does the same arithmetic batched over segments. The two agree
except where two distances tie to within fp32 rounding.
"""

from __future__ import annotations

import torch

from ..distributed import LOCAL, HeadShards

try:  # Triton ships for Linux only; the torch reference works everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without triton
    triton = None
    tl = None

__all__ = ["kmeans_select", "kmeans_select_reference", "DEFAULT_ITERS"]

DEFAULT_ITERS = 10
MAX_TRITON_TOKENS = 256  # one program holds an [N, N] Gram tile and [N, K] distances in registers
BACKENDS = ("triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_F = 64  # feature columns per step of the Gram loop
BLOCK_I = 32  # tokens per step of the (Gram x weights) product
LAUNCH_OPTS = {"enable_fp_fusion": False}  # no FMA contraction: same roundings as torch on GPU
TIE_REL = 2.0**-16  # selection ties: relative to the size of the terms in |x|^2 - 2 x.c + |c|^2


def kmeans_select(
    keys: torch.Tensor,
    valid: torch.Tensor,
    k: torch.Tensor | int,
    iters: int = DEFAULT_ITERS,
    backend: str | None = None,
    max_k: int | None = None,
    validate: bool = True,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    heads: HeadShards = LOCAL,
) -> torch.Tensor:
    """Keep mask ``[S, N]`` choosing ``min(k[s], live[s])`` representative tokens per segment.

    Args:
        keys: ``[S, N, F]`` post-RoPE keys of S segments (KV heads flattened into F).
            Dead slots may hold anything, NaN included; they are never read into sums.
            With ``slots``: a layer's keys ``[B, Hkv, L, D]`` (F = Hkv * D), read in place.
        valid: ``[S, N]`` bool, True for the segment's live tokens.
        k: target count per segment, an int tensor ``[S]`` or one Python int for all.
        iters: Lloyd rounds, a fixed count (0 keeps the nearest tokens to the seeds,
            i.e. the seeds themselves).
        backend: ``"triton"`` / ``"torch"`` forces one; ``None`` picks Triton for CUDA
            tensors or interpreted kernels (``TRITON_INTERPRET=1``), else torch.
        max_k: an upper bound on ``k`` known to the caller (ThinKV: 64). It sizes the
            kernel's centroid tile; without it (and with a tensor ``k``) the tile is
            sized for N. Larger ``k`` values are clamped to it.
        validate: check for NaN/inf in live keys and for ``k`` outside ``[0, max_k]``;
            this costs one device-to-host sync. Hot paths that trust their inputs pass False.
        slots: ``(rows [S], cols [S, N])``: token ``i`` of segment ``s`` is
            ``keys[rows[s], :, cols[s, i]]``, so segments scattered over a layer's slots need
            no gathered copy (an evictor's segments of a whole batch would be one the size
            of the layer). A segment with ``k = 0`` costs the kernel almost nothing.
        heads: the tensor-parallel ranks that hold the other KV heads of these keys; when
            there are several, the Gram matrix is summed over them (one all-reduce of each
            segment's ``[N, N]`` Gram, which the kernel then reads instead of forming its own),
            so every rank clusters on the keys of all heads and keeps the same tokens.

    Returns:
        ``[S, N]`` bool keep mask on ``keys.device``.
    """
    (k_eff, given), bound = _prepare(keys, valid, k, iters, max_k, slots)
    if validate:
        _check_values(_gathered(keys, slots), valid, given, max_k)
    if not _use_triton(valid, backend):
        return _reference(_gathered(keys, slots), valid, k_eff, iters, bound, heads)[0]
    return _kmeans_triton(keys, valid, k_eff, iters, bound, slots, heads)


def kmeans_select_reference(
    keys: torch.Tensor,
    valid: torch.Tensor,
    k: torch.Tensor | int,
    iters: int = DEFAULT_ITERS,
    max_k: int | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`kmeans_select` (same seeds, rounds and selection), without value checks."""
    (k_eff, _), bound = _prepare(keys, valid, k, iters, max_k)
    return _reference(keys, valid, k_eff, iters, bound)[0]


# ---------------------------------------------------------------------------
# Checks and dispatch


def _segment_shape(keys, valid, slots) -> tuple[int, int, int]:
    """``(S, N, F)`` of the segments, checking the layout of ``keys`` (and ``slots``)."""
    shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
    if slots is None:
        if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
            raise ValueError(f"kmeans_select: keys must be [S, N, F] (segments, tokens, features), got {shape}")
        return tuple(keys.shape)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        raise ValueError(f"kmeans_select: with slots, keys must be a layer's [B, Hkv, L, D], got {shape}")
    rows, cols = slots
    n = valid.shape[1] if isinstance(valid, torch.Tensor) and valid.dim() == 2 else -1
    if (rows.dim() != 1 or tuple(cols.shape) != (rows.shape[0], n) or rows.dtype != torch.long
            or cols.dtype != torch.long or rows.device != keys.device or cols.device != keys.device):
        raise ValueError(
            f"kmeans_select: slots must be long tensors rows [S] and cols [S, N] on {keys.device} matching valid "
            f"[S, N]; got rows {tuple(rows.shape)} {rows.dtype}, cols {tuple(cols.shape)} {cols.dtype}"
        )
    return rows.shape[0], n, keys.shape[1] * keys.shape[3]


def _gathered(keys, slots):
    """The segments' keys ``[S, N, F]`` as a copy (reference path and checks)."""
    if slots is None:
        return keys
    rows, cols = slots
    b, h, l, d = keys.shape
    return keys.permute(0, 2, 1, 3)[rows[:, None], cols].reshape(cols.shape[0], cols.shape[1], h * d)


def _prepare(keys, valid, k, iters, max_k, slots=None):
    """Check shapes and arguments; return ((k_eff [S] int32, k as given [S]), centroid bound)."""
    s, n, f = _segment_shape(keys, valid, slots)
    if keys.dtype not in FLOAT_DTYPES:
        raise ValueError(f"kmeans_select: keys dtype {keys.dtype} is not one of fp16, bf16, fp32")
    if not isinstance(valid, torch.Tensor) or tuple(valid.shape) != (s, n) or valid.dtype != torch.bool:
        got = f"{tuple(valid.shape)} {valid.dtype}" if isinstance(valid, torch.Tensor) else type(valid).__name__
        raise ValueError(
            f"kmeans_select: valid must be a bool [S, N] = {(s, n)} mask for keys {tuple(keys.shape)}, got {got}"
        )
    if valid.device != keys.device:
        raise ValueError(f"kmeans_select: valid is on {valid.device} but keys on {keys.device}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"kmeans_select: iters must be an int >= 0, got {iters!r}")
    if max_k is not None and (isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1):
        raise ValueError(f"kmeans_select: max_k must be an int >= 1 or None, got {max_k!r}")
    if isinstance(k, bool):
        raise ValueError(f"kmeans_select: k must be an int or an int tensor [S], got {k!r}")
    if isinstance(k, int):
        if k < 0:
            raise ValueError(f"kmeans_select: k must be >= 0, got {k}")
        given = torch.full((s,), k, dtype=torch.int64, device=keys.device)
        bound = min(k, n) if max_k is None else min(k, max_k, n)
    elif isinstance(k, torch.Tensor):
        if tuple(k.shape) != (s,) or k.dtype.is_floating_point or k.dtype.is_complex or k.dtype == torch.bool:
            raise ValueError(
                f"kmeans_select: k must be an int tensor of shape ({s},) (one target per segment), "
                f"got shape {tuple(k.shape)} dtype {k.dtype}"
            )
        if k.device != keys.device:
            raise ValueError(f"kmeans_select: k is on {k.device} but keys on {keys.device}")
        given = k.to(torch.int64)
        bound = n if max_k is None else min(max_k, n)
    else:
        raise ValueError(f"kmeans_select: k must be an int or an int tensor [S], got {type(k).__name__}")
    live = valid.sum(dim=1)
    k_eff = torch.minimum(given.clamp(0, max(bound, 0)), live).to(torch.int32)
    return (k_eff, given), max(bound, 1)


def _check_values(keys, valid, given, max_k):
    """NaN/inf in a live key would poison its centroid; a k above max_k would be silently clamped."""
    keys_ok = (torch.isfinite(keys).all(dim=-1) | ~valid).all()
    high = given.max() if given.numel() else torch.zeros((), dtype=given.dtype, device=given.device)
    low = given.min() if given.numel() else torch.zeros((), dtype=given.dtype, device=given.device)
    ok, k_low, k_high = torch.stack([keys_ok.to(given.dtype), low, high]).tolist()  # the one host sync
    if not ok:
        raise ValueError(f"kmeans_select: keys {tuple(keys.shape)} contain NaN or inf in live tokens")
    if k_low < 0:
        raise ValueError(f"kmeans_select: k must be >= 0, got a minimum of {k_low}")
    if max_k is not None and k_high > max_k:
        raise ValueError(f"kmeans_select: k has values up to {k_high} but max_k is {max_k}")


def _use_triton(x: torch.Tensor, backend: str | None) -> bool:
    """Triton for CUDA tensors or interpreted kernels (TRITON_INTERPRET=1); torch otherwise."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"kmeans_select: unknown backend {backend!r}; accepted: None, 'triton', 'torch'")
    if backend == "torch":
        return False
    runnable = triton is not None and (x.is_cuda or _interpreted())
    if backend == "triton" and not runnable:
        why = "Triton is not installed" if triton is None else "tensors are on CPU and TRITON_INTERPRET is not set"
        raise RuntimeError(f"kmeans_select: backend='triton' cannot run: {why}")
    if runnable and x.shape[1] > MAX_TRITON_TOKENS:
        if backend == "triton":
            raise ValueError(
                f"kmeans_select: the Triton kernel takes at most {MAX_TRITON_TOKENS} tokens per segment, "
                f"got {x.shape[1]}; use backend='torch'"
            )
        return False
    return runnable


def _interpreted() -> bool:
    # triton.jit reads TRITON_INTERPRET when this module is imported; the kernel object tells.
    return triton is not None and type(_kmeans_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (int(n) - 1).bit_length()))


# ---------------------------------------------------------------------------
# Torch reference


def _reference(keys, valid, k_eff, iters, bound, heads: HeadShards = LOCAL):
    """Returns (keep [S, N], seeds [S, bound], weights [S, N, bound], final distances [S, N, bound])."""
    s, n, f = keys.shape
    dev = keys.device
    live = valid
    cols = torch.arange(bound, device=dev)
    rows = torch.arange(s, device=dev)
    tok = torch.arange(n, device=dev)
    active_c = cols[None, :] < k_eff[:, None]  # [S, bound]

    # 1. farthest-first seeds from the Gram matrix
    gram = _live_gram(keys, live, heads)
    sq = gram.diagonal(dim1=1, dim2=2)
    far = torch.where(live, torch.full_like(sq, float("inf")), torch.full_like(sq, float("-inf")))
    seeds = torch.zeros(s, bound, dtype=torch.long, device=dev)
    for t in range(bound):
        on = (t < k_eff)[:, None]
        p = far.argmax(dim=1)
        seeds[:, t] = torch.where(on[:, 0], p, seeds[:, t])
        d = sq - 2.0 * gram[rows, :, p] + sq[rows, p][:, None]
        new_far = torch.minimum(far, d).masked_fill(tok[None, :] == p[:, None], float("-inf"))
        far = torch.where(on, new_far, far)

    # 2. Lloyd rounds on token weights: centroid c = sum_i w[i, c] x_i
    weights = ((tok[None, :, None] == seeds[:, None, :]) & active_c[:, None, :]).to(torch.float32)
    for it in range(iters + 1):
        dots = gram @ weights  # x_j . c
        cc = (weights * dots).sum(dim=1)  # |c|^2
        if it == iters:
            break
        dist = (cc[:, None, :] - 2.0 * dots).masked_fill(~active_c[:, None, :], float("inf"))
        assign = dist.argmin(dim=-1)
        onehot = ((assign[..., None] == cols) & live[..., None]).to(torch.float32)
        count = onehot.sum(dim=1, keepdim=True)
        weights = torch.where(count > 0, onehot / count.clamp(min=1.0), weights)

    # 3. greedy nearest-token selection in seed order
    dist = (sq[..., None] - 2.0 * dots + cc[:, None, :]).masked_fill(~live[..., None], float("inf"))
    sq_max = torch.where(live, sq, torch.zeros_like(sq)).amax(dim=1) if n else sq.new_zeros(s)
    cc_max = torch.where(active_c, cc, torch.zeros_like(cc)).amax(dim=1)
    tol = TIE_REL * (cc_max + sq_max)
    keep = torch.zeros(s, n, dtype=torch.bool, device=dev)
    for t in range(bound):
        on = t < k_eff
        col = dist[:, :, t].masked_fill(keep, float("inf"))
        near = col.amin(dim=1) + tol
        p = torch.where(col <= near[:, None], tok, n).amin(dim=1).clamp(max=max(n - 1, 0))
        keep[rows, p] |= on
    return keep, seeds, weights, dist


# ---------------------------------------------------------------------------
# Triton path


def _kmeans_triton(keys, valid, k_eff, iters, bound, slots, heads: HeadShards = LOCAL):
    s, n, f = valid.shape[0], valid.shape[1], _segment_shape(keys, valid, slots)[2]
    keep = torch.zeros(s, n, dtype=torch.int8, device=keys.device)
    if s == 0 or n == 0:  # every rank has the same segments: none of them reduces
        return keep.bool()
    np_, kp = _pow2(n), _pow2(bound)
    live = valid  # bool: the kernel reads it as bytes
    # Where each token's features start (elements from keys' base), and how a feature index
    # maps to memory: f = head * FD + d (one head of FD features for [S, N, F] keys).
    if slots is None:
        rows, cols = torch.arange(s, device=keys.device), torch.arange(n, device=keys.device).expand(s, n)
        token_start = rows[:, None] * keys.stride(0) + cols * keys.stride(1)
        fd, head_stride, feature_stride = f, 0, keys.stride(2)
    else:
        rows, cols = slots
        token_start = rows[:, None] * keys.stride(0) + cols * keys.stride(2)
        fd, head_stride, feature_stride = keys.shape[3], keys.stride(1), keys.stride(3)
    # Per segment: the Gram matrix (later the [K, N] distances; NP >= KP) and the token weights.
    # Under tensor parallelism the Gram of every rank's heads comes in: this rank's, all-reduced.
    scratch = _sharded_gram(keys, valid, slots, np_, heads) if heads.sharded else \
        torch.empty(s, np_, np_, dtype=torch.float32, device=keys.device)
    weights = torch.empty(s, np_, kp, dtype=torch.float32, device=keys.device)
    # Half-precision keys on GPU: tensor-core Gram (products are exact in fp32, sums in fp32).
    native = keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16)
    _kmeans_kernel[(s,)](
        keys, token_start.contiguous(), live, k_eff, scratch, weights, keep,
        n, f, fd, iters,
        head_stride, feature_stride, live.stride(0), live.stride(1),
        NP=np_, KP=kp, BF=BLOCK_F, BI=min(BLOCK_I, np_), TIE_REL=TIE_REL, NATIVE_DOT=native,
        GRAM_GIVEN=heads.sharded, num_warps=8, **LAUNCH_OPTS,
    )
    return keep.bool()


def _live_gram(keys: torch.Tensor, valid: torch.Tensor, heads: HeadShards) -> torch.Tensor:
    """``[S, N, N]`` fp32 Gram matrix of each segment's live keys ``[S, N, F]`` (zero rows and
    columns for dead slots), over the heads of every tensor-parallel rank (one all-reduce)."""
    x = torch.where(valid[..., None], keys.to(torch.float32), torch.zeros((), device=keys.device))
    return heads.all_sum(x @ x.transpose(1, 2))


def _sharded_gram(keys, valid, slots, np_: int, heads: HeadShards) -> torch.Tensor:
    """The kernel's ``[S, NP, NP]`` scratch holding :func:`_live_gram` over every rank's heads,
    zero where padded, as the kernel forms it from one rank's keys."""
    s, n = valid.shape
    gram = torch.zeros(s, np_, np_, dtype=torch.float32, device=valid.device)
    gram[:, :n, :n] = _live_gram(_gathered(keys, slots), valid, heads)
    return gram


if triton is not None:

    @triton.jit
    def _kmeans_kernel(
        x_ptr, start_ptr, live_ptr, k_ptr, gram_ptr, w_ptr, keep_ptr,
        N, F, FD, ITERS,
        sxh, sxf, svs, svn,
        NP: tl.constexpr, KP: tl.constexpr, BF: tl.constexpr, BI: tl.constexpr,
        TIE_REL: tl.constexpr, NATIVE_DOT: tl.constexpr, GRAM_GIVEN: tl.constexpr,
    ):
        """One segment: Gram matrix, farthest-first seeds, ITERS Lloyd rounds, greedy selection.
        ``GRAM_GIVEN``: the scratch already holds the Gram matrix (every tensor-parallel rank's
        heads), and the keys are not read.

        Token ``i``'s feature ``f`` lies at ``start[s, i] + (f // FD) * sxh + (f % FD) * sxf``.
        A segment with ``K = 0`` skips the work (its loops run zero times). Helpers are
        written inline (no nested jit calls) and reductions are kept out of the inner loops
        where possible: both dominate the interpreter's run time.
        """
        s = tl.program_id(0)
        tok = tl.arange(0, NP)
        cols = tl.arange(0, KP)
        fo = tl.arange(0, BF)
        ii = tl.arange(0, BI)
        live = tl.load(live_ptr + s * svs + tok * svn, mask=tok < N, other=0) != 0
        K = tl.load(k_ptr + s)
        on = K > 0
        on_tok = tok < tl.where(on, NP, 0)  # stores and loads of scratch only for a segment with work
        c_on = cols < K
        x_rows = x_ptr + tl.load(start_ptr + s * N + tok, mask=tok < N, other=0)[:, None]
        g_base = gram_ptr + s * NP * NP
        w_base = w_ptr + s * NP * KP

        # 1. Gram matrix of the live keys (the only pass over them), kept in scratch.
        if not GRAM_GIVEN:
            gram = tl.zeros([NP, NP], tl.float32)
            for f0 in range(0, tl.where(on, F, 0), BF):
                f = f0 + fo
                f_at = (f // FD) * sxh + (f % FD) * sxf
                xt = tl.load(x_rows + f_at[None, :], mask=live[:, None] & (f < F)[None, :], other=0.0)
                if NATIVE_DOT:
                    gram += tl.dot(xt, tl.trans(xt))
                else:
                    xt = xt.to(tl.float32)
                    gram += tl.dot(xt, tl.trans(xt), input_precision="ieee")
            tl.store(g_base + tok[:, None] * NP + tok[None, :], gram, mask=on_tok[:, None] & on_tok[None, :])
            tl.debug_barrier()

        # Farthest-first seeds from the Gram columns.
        sq = tl.load(g_base + tok * NP + tok, mask=on_tok, other=0.0)
        far = tl.where(live, float("inf"), float("-inf"))
        seeds = tl.zeros([KP], tl.int32)
        for t in range(0, K):
            p = tl.argmax(far, axis=0)
            seeds = tl.where(cols == t, p, seeds)
            d = sq - 2.0 * tl.load(g_base + tok * NP + p) + tl.load(g_base + p * NP + p)
            far = tl.where(tok == p, float("-inf"), tl.minimum(far, d))

        # 2. Lloyd rounds. A centroid is a weighted sum of tokens, c = sum_i w_ic x_i, so
        # x_j . c = (G W)_jc and |c|^2 = sum_j W_jc (G W)_jc: no further pass over the keys.
        # The last pass of the loop only measures (dots and |c|^2 for step 3).
        w = tl.where((tok[:, None] == seeds[None, :]) & c_on[None, :], 1.0, 0.0)
        tl.store(w_base + tok[:, None] * KP + cols[None, :], w, mask=on_tok[:, None] & (cols >= 0)[None, :])
        tl.debug_barrier()
        dots = tl.zeros([NP, KP], tl.float32)
        cc = tl.zeros([KP], tl.float32)
        for it in range(0, tl.where(on, ITERS + 1, 0)):
            dots = tl.zeros([NP, KP], tl.float32)
            for i0 in tl.static_range(0, NP, BI):
                gt = tl.load(g_base + tok[:, None] * NP + (i0 + ii)[None, :])
                wt = tl.load(w_base + (i0 + ii)[:, None] * KP + cols[None, :])
                dots += tl.dot(gt, wt, input_precision="ieee")
            cc = tl.sum(w * dots, axis=0)
            if it < ITERS:
                assign = tl.argmin(tl.where(c_on[None, :], cc[None, :] - 2.0 * dots, float("inf")), axis=1)
                onehot = tl.where((assign[:, None] == cols[None, :]) & live[:, None], 1.0, 0.0)
                count = tl.sum(onehot, axis=0)
                share = tl.div_rn(onehot, tl.broadcast_to(tl.maximum(count, 1.0)[None, :], [NP, KP]))
                w = tl.where((count > 0)[None, :], share, w)
                tl.debug_barrier()
                tl.store(w_base + tok[:, None] * KP + cols[None, :], w)
                tl.debug_barrier()

        # 3. Each centroid in seed order keeps its nearest live token not kept yet; the
        # distance columns go through the (now free) Gram scratch so each is one load.
        dist = tl.where(live[:, None], sq[:, None] - 2.0 * dots + cc[None, :], float("inf"))
        tl.debug_barrier()
        tl.store(g_base + cols[None, :] * NP + tok[:, None], dist, mask=on_tok[:, None] & (cols >= 0)[None, :])
        tl.debug_barrier()
        tol = TIE_REL * (tl.max(tl.where(c_on, cc, 0.0), axis=0) + tl.max(tl.where(live, sq, 0.0), axis=0))
        kept = tok < 0
        for t in range(0, K):
            col = tl.where(kept, float("inf"), tl.load(g_base + t * NP + tok))
            p = tl.min(tl.where(col <= tl.min(col, axis=0) + tol, tok, NP), axis=0)
            kept = kept | (tok == p)
        tl.store(keep_ptr + s * N + tok, kept.to(tl.int8), mask=tok < N)

else:  # pragma: no cover - platforms without triton
    _kmeans_kernel = None
