"""Attention sparsity of one decode query per sequence: ThinKV's thought-type signal.

ThinKV (§3.1.2) tells reasoning, execution and transition thoughts apart by how
sparse a decode step's attention row is: the fraction of keys whose normalized
attention weight lies below 1% of the row's maximum (the H2O measure). This module
computes that fraction for a batch of decode queries over a KV cache whose live
slots are given by a mask.

How GQA query heads become one number per sequence (our reading of appendix C.2,
Eqs. 2-4 and the sentence after them):

1. per query head ``i``: ``p_i = softmax(q_i · K^T * scaling)`` over the live slots;
2. per KV group ``g`` (the query heads sharing one KV head): element-wise max over
   the group's query heads, ``m_g[j] = max_i p_i[j]`` (Eq. 3);
3. renormalize along the keys: ``a_g = m_g / sum_j m_g[j]`` (Eq. 4);
4. "for sparsity analysis, attention scores are averaged across groups":
   ``combine="scores"`` (default, the literal text) averages the group rows,
   ``a = mean_g a_g``, and measures the sparsity of that one row;
   ``combine="sparsity"`` measures each group row's sparsity and averages the
   fractions instead. The two agree for one KV head (MHA with one head, or a
   single group) and differ when groups attend to different keys. Step 3 only
   matters for ``"scores"`` (each group then weighs the same in the average); the
   threshold is relative to the row maximum, so it does not change a single row's
   sparsity. Multi-head attention is the special case of groups of size 1.

Sparsity of a row ``a`` = (number of live slots ``j`` with ``a[j] < threshold *
max_j a[j]``) / (number of live slots). A sequence with no live slot gets 0.
ThinKV then averages this over a few calibrated layers; that is the caller's job.

The Triton path streams the keys twice, one program per (KV head, sequence, chunk of
slots): pass 1 keeps an online softmax maximum and normalizer per query head and
chunk; pass 2 merges those statistics and recomputes the logits, then counts
(``"sparsity"``; the group row's maximum is ``max_i 1/l_i`` because each query row
peaks at ``exp(0)/l_i``) per chunk, or (``"scores"``) writes the group's max-pooled
row and its chunk sum to a small fp32 buffer; a third kernel, one program per
sequence, adds up the chunks and, for ``"scores"``, averages the renormalized group
rows and counts. Rows are cut into chunks only when batch x KV
heads is too small to fill the GPU (about 4 programs per SM); at decode batch 1 that
is what keeps the kernel from running on 8 of 132 SMs. Nothing synchronizes with
the host except the optional input check.
"""

from __future__ import annotations

import functools
import math

import torch

from ..distributed import LOCAL, HeadShards

try:  # Triton ships for Linux only; the torch reference works everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without triton
    triton = None
    tl = None

__all__ = ["attention_sparsity", "attention_sparsity_reference", "COMBINE_MODES"]

COMBINE_MODES = ("scores", "sparsity")
BACKENDS = ("triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_L = 64  # key slots per loop step of the two passes over the keys
COMBINE_BLOCK = 1024  # slots per loop step when averaging the pooled group rows


# ---------------------------------------------------------------------------
# Public entry point


def attention_sparsity(
    query: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    group_size: int | None = None,
    threshold: float = 0.01,
    backend: str | None = None,
    combine: str = "scores",
    validate: bool = True,
    heads: HeadShards = LOCAL,
) -> torch.Tensor:
    """Fraction of live key slots a decode query (nearly) ignores, per sequence.

    Args:
        query: ``[B, Hq, D]`` one decode query per sequence (post-RoPE, as attention sees it).
        keys: ``[B, Hkv, L, D]`` cached keys; any strides.
        valid: ``[B, L]`` bool, True for live slots. Dead slots may hold anything
            (NaN included): they are masked before any arithmetic touches the result.
        scaling: logit scale, usually ``D ** -0.5``.
        group_size: query heads per KV head; ``None`` infers ``Hq // Hkv``. Given
            explicitly, it must satisfy ``Hq == group_size * Hkv``.
        threshold: a weight counts as zero below ``threshold`` times its row's maximum
            (ThinKV: 0.01).
        backend: ``"triton"`` or ``"torch"`` forces one; ``None`` picks Triton for CUDA
            tensors or when kernels are interpreted (``TRITON_INTERPRET=1``), else torch.
        combine: ``"scores"`` or ``"sparsity"``, how KV groups are combined (module doc).
        validate: check for NaN/inf in ``query`` and in the live slots of ``keys``; this
            costs one device-to-host sync. Hot paths that trust their inputs pass False.
        heads: the tensor-parallel ranks that hold the layer's other KV heads; when there are
            several, KV groups combine over all of them: the kernels pool this rank's heads, and
            one all-reduce of the pooled rows (or of the per-head fractions) combines the ranks.

    Returns:
        ``[B]`` float32 sparsity in ``[0, 1]`` on the inputs' device.
    """
    b, hq, hkv, length, d = _check_inputs(query, keys, valid, scaling, group_size, threshold, combine)
    if validate:
        _check_finite(query, keys, valid)
    if not _use_triton(keys, backend):
        return attention_sparsity_reference(query, keys, valid, scaling, hq // hkv, threshold, combine, heads)
    return _sparsity_triton(query, keys, valid, float(scaling), hq // hkv, float(threshold), combine, heads)


def attention_sparsity_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    group_size: int | None = None,
    threshold: float = 0.01,
    combine: str = "scores",
    heads: HeadShards = LOCAL,
) -> torch.Tensor:
    """Plain-torch version of :func:`attention_sparsity`, written step by step as in the paper.

    Materializes the fp32 probabilities ``[B, Hq, L]``; no input checks beyond shapes.
    """
    b, hq, d = query.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = group_size or hq // hkv
    if length == 0:
        return torch.zeros(b, dtype=torch.float32, device=query.device)
    live = valid.to(torch.bool)
    logits = torch.einsum("bhgd,bhld->bhgl", query.float().reshape(b, hkv, g, d), keys.float()) * scaling
    logits = logits.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # Eq. 2; NaN rows when no slot is live
    probs = torch.where(live[:, None, None, :], probs, torch.zeros_like(probs))
    pooled = probs.amax(dim=2)  # Eq. 3: [B, Hkv, L]
    total = pooled.sum(dim=-1)
    if combine == "scores":
        return _below_mean_row(pooled, total, live, threshold, heads)
    rows = pooled / torch.where(total > 0, total, 1.0)[..., None]  # Eq. 4
    below = (rows < threshold * rows.amax(dim=-1, keepdim=True)) & live[:, None, :]
    n_live = live.sum(dim=-1, keepdim=True).to(torch.float32)
    return heads.mean(below.sum(dim=-1).to(torch.float32) / n_live.clamp(min=1.0), dim=1)


def _below_mean_row(pooled, totals, live, threshold: float, heads: HeadShards) -> torch.Tensor:
    """``combine="scores"`` from the pooled rows ``[B, H, L]`` and their sums ``[B, H]``: each row
    renormalized (Eq. 4), averaged over the KV heads of every rank, and the share of live slots
    below ``threshold`` times the average's maximum. The reference and the kernels' tensor-parallel
    combine both end here."""
    avg = heads.mean(pooled / torch.where(totals > 0, totals, 1.0)[..., None], dim=1)  # [B, L]
    below = (avg < threshold * avg.amax(dim=-1, keepdim=True)) & live.to(torch.bool)
    return below.sum(dim=-1).to(torch.float32) / live.sum(dim=-1).to(torch.float32).clamp(min=1.0)


# ---------------------------------------------------------------------------
# Checks and dispatch


def _check_inputs(query, keys, valid, scaling, group_size, threshold, combine):
    """Shape, dtype, device and argument checks; errors name the tensors and their shapes."""
    for name, t in (("query", query), ("keys", keys), ("valid", valid)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention_sparsity: {name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 3:
        raise ValueError(f"attention_sparsity: query must be [B, Hq, D], got shape {tuple(query.shape)}")
    if keys.dim() != 4:
        raise ValueError(f"attention_sparsity: keys must be [B, Hkv, L, D], got shape {tuple(keys.shape)}")
    b, hq, d = query.shape
    kb, hkv, length, kd = keys.shape
    if kb != b or kd != d:
        raise ValueError(
            "attention_sparsity: query [B, Hq, D] and keys [B, Hkv, L, D] disagree on B or D: "
            f"query {tuple(query.shape)}, keys {tuple(keys.shape)}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"attention_sparsity: query heads ({hq}) must be a positive multiple of KV heads ({hkv}); "
            f"query {tuple(query.shape)}, keys {tuple(keys.shape)}"
        )
    if group_size is not None and (isinstance(group_size, bool) or group_size * hkv != hq):
        raise ValueError(
            f"attention_sparsity: group_size={group_size!r} but query has {hq} heads and keys {hkv} KV heads "
            f"(query {tuple(query.shape)}, keys {tuple(keys.shape)})"
        )
    if tuple(valid.shape) != (b, length):
        raise ValueError(
            f"attention_sparsity: valid must be [B, L] = {(b, length)} to match keys {tuple(keys.shape)}, "
            f"got shape {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"attention_sparsity: valid must be a bool mask, got dtype {valid.dtype}")
    for name, t in (("query", query), ("keys", keys)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"attention_sparsity: {name} dtype {t.dtype} is not one of fp16, bf16, fp32")
    if not (query.device == keys.device == valid.device):
        raise ValueError(
            f"attention_sparsity: tensors on different devices: query {query.device}, keys {keys.device}, "
            f"valid {valid.device}"
        )
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) or scaling <= 0:
        raise ValueError(f"attention_sparsity: scaling must be a finite number > 0, got {scaling!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise ValueError(f"attention_sparsity: threshold must be a number in [0, 1], got {threshold!r}")
    if combine not in COMBINE_MODES:
        raise ValueError(f"attention_sparsity: combine must be one of {COMBINE_MODES}, got {combine!r}")
    return b, hq, hkv, length, d


def _check_finite(query, keys, valid):
    """NaN/inf in a live logit would silently turn a whole row's sparsity into garbage; refuse."""
    keys_ok = (torch.isfinite(keys).all(dim=-1) | ~valid[:, None, :]).all()
    flags = torch.stack([torch.isfinite(query).all(), keys_ok]).tolist()  # the one host sync
    if not flags[0]:
        raise ValueError(f"attention_sparsity: query {tuple(query.shape)} contains NaN or inf")
    if not flags[1]:
        raise ValueError(f"attention_sparsity: keys {tuple(keys.shape)} contain NaN or inf in live slots")


def _use_triton(x: torch.Tensor, backend: str | None) -> bool:
    """Triton for CUDA tensors or interpreted kernels (TRITON_INTERPRET=1); torch otherwise."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"attention_sparsity: unknown backend {backend!r}; accepted: None, 'triton', 'torch'")
    if backend == "torch":
        return False
    runnable = triton is not None and (x.is_cuda or _interpreted())
    if backend == "triton" and not runnable:
        why = "Triton is not installed" if triton is None else "tensors are on CPU and TRITON_INTERPRET is not set"
        raise RuntimeError(f"attention_sparsity: backend='triton' cannot run: {why}")
    return runnable


def _interpreted() -> bool:
    # triton.jit reads TRITON_INTERPRET when this module is imported; the kernel object tells.
    return triton is not None and type(_group_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (int(n) - 1).bit_length()))


# ---------------------------------------------------------------------------
# Triton path


def _sparsity_triton(query, keys, valid, scaling, group, threshold, combine, heads: HeadShards = LOCAL):
    b, hq, d = query.shape
    hkv, length = keys.shape[1], keys.shape[2]
    dev = keys.device
    if b == 0 or length == 0:
        return torch.zeros(b, dtype=torch.float32, device=dev)
    live = valid  # bool: kernels read it as bytes
    # On GPU, half-precision pairs go to tensor cores (exact products, fp32 sums); anything else,
    # and everything in the interpreter (whose half-precision dot is not faithful), in fp32 IEEE.
    half_pair = query.dtype == keys.dtype and keys.dtype in (torch.float16, torch.bfloat16)
    ieee = not (half_pair and keys.is_cuda)
    scores = combine == "scores"
    gp = _pow2(group, 16)
    chunks, chunk_len = _split(b * hkv, length, dev)
    part_m = torch.empty(b, hkv, chunks, gp, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part = torch.empty(b, hkv, chunks, dtype=torch.float32, device=dev)
    pooled = torch.empty(b, hkv, length, dtype=torch.float32, device=dev) if scores else part
    out = torch.empty(b, dtype=torch.float32, device=dev)
    common = dict(GROUP=group, D=d, GP=gp, DP=_pow2(d, 16), BLOCK_L=BLOCK_L, IEEE=ieee, num_warps=4)
    strides = (query.stride(0), query.stride(1), query.stride(2),
               keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3), live.stride(0), live.stride(1))
    grid = (hkv, b, chunks)
    cp = _pow2(chunks)
    _stats_kernel[grid](query, keys, live, part_m, part_l, length, chunk_len, scaling, *strides, **common)
    _group_kernel[grid](query, keys, live, part_m, part_l, part, pooled, length, chunk_len, scaling, threshold,
                        *strides, CP=cp, SCORES=scores, **common)
    if heads.sharded:
        return _combine_over_ranks(pooled, part, live, threshold, scores, heads)
    _combine_kernel[(b,)](
        pooled, part, live, out, length, chunks, threshold, live.stride(0), live.stride(1),
        H=hkv, HP=_pow2(hkv), CP=cp, BLOCK_L=COMBINE_BLOCK, SCORES=scores, num_warps=4,
    )
    return out


def _combine_over_ranks(pooled, part, live, threshold: float, scores: bool, heads: HeadShards) -> torch.Tensor:
    """What :func:`_combine_kernel` computes, over the KV heads of every tensor-parallel rank: the
    renormalized pooled rows ``[B, H, L]`` (or the per-head below-threshold counts) averaged over
    all heads by one all-reduce, then the fraction of live slots below the threshold."""
    per_head = part.sum(dim=2)  # [B, H]: each head's pooled total, or its count below the threshold
    if scores:
        return _below_mean_row(pooled, per_head, live, threshold, heads)
    return heads.mean(per_head, dim=1) / live.sum(dim=1).to(torch.float32).clamp(min=1.0)


def _split(rows: int, length: int, device: torch.device) -> tuple[int, int]:
    """Cut each (sequence, KV head) row into chunks so that small batches still fill the GPU.

    Returns (number of chunks, slots per chunk); the chunk length is a multiple of BLOCK_L.
    """
    blocks = -(-length // BLOCK_L)
    target = 4 * _sm_count(device.index) if device.type == "cuda" else 8
    chunks = min(blocks, max(1, -(-target // rows)))
    chunk_len = -(-blocks // chunks) * BLOCK_L
    return -(-length // chunk_len), chunk_len


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    index = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


if triton is not None:

    @triton.jit
    def _logits(q, k_ptr, offs, dcols, live, D, skl, skd, scaling, IEEE: tl.constexpr):
        """Logits ``[GP, BLOCK_L]`` of the group's queries against one block of keys.

        Dead slots are not read (they may hold garbage, and skipping them saves bandwidth).
        """
        kk = tl.load(k_ptr + offs[:, None] * skl + dcols[None, :] * skd,
                     mask=live[:, None] & (dcols[None, :] < D), other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(kk.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(kk.dtype), tl.trans(kk))
        return s * scaling

    @triton.jit
    def _stats_kernel(
        q_ptr, k_ptr, live_ptr, m_ptr, l_ptr,
        L, CHUNK, scaling,
        sqb, sqh, sqd, skb, skh, skl, skd, svb, svl,
        GROUP: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
        BLOCK_L: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Pass 1, one (KV head, sequence, chunk): running max and normalizer of each query row."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        c = tl.program_id(2)
        rows = tl.arange(0, GP)
        dcols = tl.arange(0, DP)
        lanes = tl.arange(0, BLOCK_L)
        q = tl.load(q_ptr + b * sqb + (h * GROUP + rows)[:, None] * sqh + dcols[None, :] * sqd,
                    mask=(rows < GROUP)[:, None] & (dcols[None, :] < D), other=0.0)
        k_base = k_ptr + b * skb + h * skh
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, L), BLOCK_L):
            offs = start + lanes
            live = tl.load(live_ptr + b * svb + offs * svl, mask=offs < L, other=0) != 0
            s = _logits(q, k_base, offs, dcols, live, D, skl, skd, scaling, IEEE)
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_ref) + tl.sum(tl.exp(s - m_ref[:, None]), axis=1)
            m = m_new
        out = ((b * tl.num_programs(0) + h) * tl.num_programs(2) + c) * GP + rows
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, l)

    @triton.jit
    def _group_kernel(
        q_ptr, k_ptr, live_ptr, m_ptr, l_ptr, part_ptr, pooled_ptr,
        L, CHUNK, scaling, threshold,
        sqb, sqh, sqd, skb, skh, skl, skd, svb, svl,
        GROUP: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
        BLOCK_L: tl.constexpr, IEEE: tl.constexpr, CP: tl.constexpr, SCORES: tl.constexpr,
    ):
        """Pass 2, one (KV head, sequence, chunk): the max-pooled group row over the chunk.

        Merges every chunk's softmax statistics first. ``SCORES``: writes the pooled row
        and its chunk sum (Eq. 4's normalizer); otherwise counts the slots whose pooled
        weight is below ``threshold`` times the row maximum, ``max_i 1/l_i``.
        """
        h = tl.program_id(0)
        b = tl.program_id(1)
        c = tl.program_id(2)
        n_heads = tl.num_programs(0)
        n_chunks = tl.num_programs(2)
        rows = tl.arange(0, GP)
        dcols = tl.arange(0, DP)
        lanes = tl.arange(0, BLOCK_L)
        chunk_ids = tl.arange(0, CP)
        row_ok = rows < GROUP
        stats = ((b * n_heads + h) * n_chunks + chunk_ids[:, None]) * GP + rows[None, :]
        c_ok = (chunk_ids < n_chunks)[:, None]
        ms = tl.load(m_ptr + stats, mask=c_ok, other=float("-inf"))
        ls = tl.load(l_ptr + stats, mask=c_ok, other=0.0)
        m = tl.max(ms, axis=0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(ls * tl.exp(ms - m_ref[None, :]), axis=0)
        l_ok = row_ok & (l > 0)
        l_div = tl.where(l_ok, l, 1.0)
        row_max = tl.max(tl.where(l_ok, 1.0 / l_div, 0.0), axis=0)

        q = tl.load(q_ptr + b * sqb + (h * GROUP + rows)[:, None] * sqh + dcols[None, :] * sqd,
                    mask=row_ok[:, None] & (dcols[None, :] < D), other=0.0)
        k_base = k_ptr + b * skb + h * skh
        acc = tl.zeros([BLOCK_L], tl.float32)
        for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, L), BLOCK_L):
            offs = start + lanes
            in_l = offs < L
            live = tl.load(live_ptr + b * svb + offs * svl, mask=in_l, other=0) != 0
            s = _logits(q, k_base, offs, dcols, live, D, skl, skd, scaling, IEEE)
            p = tl.exp(s - m_ref[:, None]) / l_div[:, None]
            pooled = tl.max(tl.where(l_ok[:, None] & live[None, :], p, 0.0), axis=0)
            if SCORES:
                tl.store(pooled_ptr + (b * n_heads + h) * L + offs, pooled, mask=in_l)
                acc += pooled
            else:
                acc += tl.where(live & (pooled < threshold * row_max), 1.0, 0.0)
        tl.store(part_ptr + (b * n_heads + h) * n_chunks + c, tl.sum(acc, axis=0))

    @triton.jit
    def _combine_kernel(
        pooled_ptr, part_ptr, live_ptr, out_ptr, L, n_chunks, threshold, svb, svl,
        H: tl.constexpr, HP: tl.constexpr, CP: tl.constexpr, BLOCK_L: tl.constexpr, SCORES: tl.constexpr,
    ):
        """One sequence: the final fraction.

        ``SCORES``: average the renormalized group rows (pooled row / its sum), then count
        the live slots below ``threshold`` times the average's maximum. Otherwise: the
        mean over KV heads of each head's below-threshold count, over the live count.
        """
        b = tl.program_id(0)
        heads = tl.arange(0, HP)
        lanes = tl.arange(0, BLOCK_L)
        h_ok = heads < H
        chunk_ids = tl.arange(0, CP)
        per_head = tl.sum(tl.load(part_ptr + (b * H + heads[:, None]) * n_chunks + chunk_ids[None, :],
                                  mask=h_ok[:, None] & (chunk_ids < n_chunks)[None, :], other=0.0), axis=1)
        n_live = tl.zeros([BLOCK_L], tl.float32)
        if SCORES:
            sums = tl.where(per_head > 0, per_head, 1.0)
            base = pooled_ptr + b * H * L + heads[:, None] * L
            row_max = tl.zeros([BLOCK_L], tl.float32)
            for start in range(0, L, BLOCK_L):
                offs = start + lanes
                g = tl.load(base + offs[None, :], mask=h_ok[:, None] & (offs < L)[None, :], other=0.0)
                row_max = tl.maximum(row_max, tl.sum(g / sums[:, None], axis=0) / H)
            cut = threshold * tl.max(row_max, axis=0)
            count = tl.zeros([BLOCK_L], tl.float32)
            for start in range(0, L, BLOCK_L):
                offs = start + lanes
                in_l = offs < L
                live = tl.load(live_ptr + b * svb + offs * svl, mask=in_l, other=0) != 0
                g = tl.load(base + offs[None, :], mask=h_ok[:, None] & in_l[None, :], other=0.0)
                avg = tl.sum(g / sums[:, None], axis=0) / H
                count += tl.where(live & (avg < cut), 1.0, 0.0)
                n_live += tl.where(live, 1.0, 0.0)
            total = tl.sum(count, axis=0)
        else:
            for start in range(0, L, BLOCK_L):
                offs = start + lanes
                live = tl.load(live_ptr + b * svb + offs * svl, mask=offs < L, other=0) != 0
                n_live += tl.where(live, 1.0, 0.0)
            total = tl.sum(per_head, axis=0) / H
        tl.store(out_ptr + b, total / tl.maximum(tl.sum(n_live, axis=0), 1.0))

else:  # pragma: no cover - platforms without triton
    _stats_kernel = None
    _group_kernel = None
    _combine_kernel = None
