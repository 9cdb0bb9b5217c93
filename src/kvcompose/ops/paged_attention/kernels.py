"""The Triton kernels of the paged decode attention.

1. :func:`_paged_partial_kernel`: a program per (row, KV head, split of a source's tokens)
   decodes a tile of keys and values where they lie (:mod:`.decode`), scores every query
   head of the KV head's group against it with tensor-core dots, and keeps an online
   softmax; it writes a partial output and its log-sum-exp. All sources run in one
   launch; short sources (the buffer) ride on a program of a long one.
2. :func:`_merge_kernel` combines the partial results of all splits of all sources by
   their log-sum-exp; :func:`_rider_merge_kernel` does so after computing the short
   sources' partials itself, where the long ones ran in the CUDA kernel's launch.
3. :func:`_mass_kernel` (``mass``, one launch per source) turns the slots' logits, which
   the partial kernel wrote in the same pass, into probabilities against the merged
   log-sum-exp, averages them over the query heads and adds them to each slot's channel.

With a bf16 or fp16 model, ``EXACT_FORMATS`` tiles go to the tensor cores in fp16, with
the queries in fp16 after a power-of-two shift per program (exact for a bf16 query) and
the probabilities in fp16; the per-(row, head) scale multiplies the dot products in fp32.
"""

from __future__ import annotations

from ..layout import store_out_tl
from ..triton_shim import jit, tl
from .decode import _decode_parts, _fp16, _head_scale, _kivi_key_scores, _operand


@jit
def _query_part(q_ptr, qrow, gm, j: tl.constexpr, PER: tl.constexpr, D: tl.constexpr):
    """Channels ``PER * i + j`` of the group's queries ``[GP, D / PER]``, fp32."""
    i = tl.arange(0, D // PER)
    return tl.load(q_ptr + qrow[:, None] * D + PER * i[None, :] + j, mask=gm[:, None], other=0.0).to(tl.float32)


@jit
def _query_shift(amax):
    """The power of two that brings ``amax`` (the largest query magnitude of the program)
    into [2^14, 2^15): multiplied by it, a bf16 query is exact in fp16 (fp16 has the wider
    mantissa) down to elements 2^-28 of the largest. 1 for a non-finite ``amax``."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    shift = (tl.minimum(268 - e, 254) << 23).to(tl.float32, bitcast=True)  # 2^(14 - (e - 127))
    return tl.where(e < 255, shift, 1.0)


@jit
def _max_abs(x0, x1, x2, x3):
    return tl.maximum(tl.maximum(tl.max(tl.abs(x0)), tl.max(tl.abs(x1))),
                      tl.maximum(tl.max(tl.abs(x2)), tl.max(tl.abs(x3))))


#: Fields of one source's runtime tuple in a :func:`_paged_partial_kernel` launch.
SOURCE_FIELDS = ("table", "valid", "key codes", "key scale", "key minimum", "key head scale", "value codes",
                 "value scale", "value minimum", "value head scale", "table width", "head rows",
                 "tokens per split", "first program", "programs", "first partial result", "first column", "extent")


@jit
def _paged_partial_kernel(q_ptr, out_ptr, lse_ptr, score_ptr, total_splits, total_cols, qk_scale, sources,
                          CONSTS: tl.constexpr, NSRC: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                          GP: tl.constexpr, D: tl.constexpr, SCORES: tl.constexpr, PREC: tl.constexpr,
                          OUT: tl.constexpr, NATIVE: tl.constexpr):
    """Partial attention of one (row, KV head) over some splits of a layer's sources, all
    sources in one launch.

    Source ``i`` (runtime fields ``SOURCE_FIELDS``, compile-time constants ``CONSTS[i]``)
    runs its splits on ``sources[i][14]`` programs from ``program_id(1) == sources[i][13]``
    on and writes them as partial results from ``sources[i][15]`` on. A short source (the
    recent buffer) rides on a program of a long one: both branches run there one after
    the other, so it adds no program and no wave to the launch. Each branch is one source's
    loop specialized to its format; the compiled kernel takes the registers and shared
    memory of its largest branch, not their sum."""
    split = tl.program_id(1)
    for i in tl.static_range(NSRC):
        src = sources[i]
        if (split >= src[13]) & (split < src[13] + src[14]):
            local = split - src[13]
            _source_partial(q_ptr, out_ptr, lse_ptr, score_ptr, src[0], src[1], src[2], src[3], src[4], src[5],
                            src[6], src[7], src[8], src[9], src[10], src[11], src[12], local, src[14],
                            src[15] + local, total_splits, src[16], total_cols, qk_scale, src[17],
                            CONSTS[i][0], CONSTS[i][1], CONSTS[i][2], CONSTS[i][3], CONSTS[i][4], CONSTS[i][5],
                            CONSTS[i][6], CONSTS[i][7], CONSTS[i][8], CONSTS[i][9], CONSTS[i][10], CONSTS[i][11],
                            H, G, GP, D, CONSTS[i][12], CONSTS[i][13], CONSTS[i][14], CONSTS[i][15],
                            CONSTS[i][16], SCORES, PREC, OUT, NATIVE)


#: Order of a source's compile-time constants in ``CONSTS`` (see :func:`_partial_launch`).
SOURCE_CONSTS = ("KFMT", "VFMT", "KBITS", "VBITS", "KGROUP", "VGROUP", "KTG", "KPER", "VPER", "KEX", "VEX", "KFOLD",
                 "BS", "BLOCK", "STAGES", "EXTENT", "HM")


@jit
def _pool_rows(slot, head, head_rows, H: tl.constexpr, HM: tl.constexpr):
    """``[N]`` rows of ``N`` slots of one head in a source's per-slot tensors: ``slot * H + head``
    (slot-major), or ``head * head_rows + slot`` (head-major, ``head_rows`` slots per head; see
    :func:`~kvcompose.ops.paged_attention.formats.row_layout`)."""
    if HM:
        return slot + head.to(tl.int64) * head_rows
    return slot * H + head


@jit
def _source_partial(
    q_ptr, out_ptr, lse_ptr, score_ptr, table_ptr, valid_ptr,
    kc_ptr, ks_ptr, km_ptr, khs_ptr, vc_ptr, vs_ptr, vm_ptr, vhs_ptr,
    W, head_rows, tokens_per_split, local_split, n_splits, out_split, total_splits, col0, total_cols, qk_scale,
    extent_ptr,
    KFMT: tl.constexpr, VFMT: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KGROUP: tl.constexpr, VGROUP: tl.constexpr, KTG: tl.constexpr, KPER: tl.constexpr, VPER: tl.constexpr,
    KEX: tl.constexpr, VEX: tl.constexpr, KFOLD: tl.constexpr,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, EXTENT: tl.constexpr, HM: tl.constexpr,
    SCORES: tl.constexpr,
    PREC: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr,
):
    """Partial attention of one (row, KV head, split) of one source: output ``[G, D]`` and
    log2-sum-exp ``[G]``, written as partial result ``out_split``.

    Keys and values come in channel parts (see :func:`_decode_parts`); the score is the sum
    of the parts' dots, and each value part accumulates its own output columns. ``KEX`` /
    ``VEX``: the keys / values are an exact format (see the module notes) and go to the
    tensor cores in fp16. ``KFOLD``: KIVI keys scored with their group scale folded into the
    queries (:func:`_kivi_key_scores`). ``EXTENT``: the row's columns beyond ``extent_ptr[row]``
    hold no valid slot; the ``n_splits`` splits divide the row's extent instead of the table's
    width, so the work follows the live tokens of each row, not the capacity reserved for it."""
    pid = tl.program_id(0)
    row = pid // H
    head = pid % H
    g = tl.arange(0, GP)
    gm = g < G
    qrow = row * (H * G) + head * G + g  # the query heads of this KV head
    DV: tl.constexpr = D // VPER
    key_scale = qk_scale * _head_scale(khs_ptr, row, head, KFMT, H)
    q0 = _query_part(q_ptr, qrow, gm, 0, KPER, D)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPER > 1:
        q1 = _query_part(q_ptr, qrow, gm, 1, KPER, D)
    if KPER > 2:
        q2 = _query_part(q_ptr, qrow, gm, 2, KPER, D)
        q3 = _query_part(q_ptr, qrow, gm, 3, KPER, D)
    if KEX:  # fp16 queries for fp16 key tiles, shifted by a power of two to fit fp16
        shift = _query_shift(_max_abs(q0, q1, q2, q3))
        key_scale = key_scale / shift
        q0 = _fp16(q0 * shift, NATIVE)
        q1 = _fp16(q1 * shift, NATIVE)
        q2 = _fp16(q2 * shift, NATIVE)
        q3 = _fp16(q3 * shift, NATIVE)
    else:
        q0 = _operand(q0, False, OUT, NATIVE)
        q1 = _operand(q1, False, OUT, NATIVE)
        q2 = _operand(q2, False, OUT, NATIVE)
        q3 = _operand(q3, False, OUT, NATIVE)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, DV], tl.float32)
    acc1 = tl.zeros([GP, DV], tl.float32)
    acc2 = tl.zeros([GP, DV], tl.float32)
    acc3 = tl.zeros([GP, DV], tl.float32)
    limit = W * BS
    per = tokens_per_split
    if EXTENT:
        limit = tl.minimum(tl.load(extent_ptr + row).to(tl.int32), limit)
        per = tl.cdiv(tl.cdiv(limit, n_splits), BLOCK) * BLOCK
    start = local_split * per
    end = tl.minimum(start + per, limit)
    n = tl.arange(0, BLOCK)
    for t0 in tl.range(start, end, BLOCK, num_stages=STAGES):
        t = t0 + n
        inside = t < end
        blk = tl.load(table_ptr + row * W + t // BS, mask=inside, other=-1).to(tl.int64)
        slot = blk * BS + t % BS
        ok = inside & (blk >= 0)
        ok = ok & (tl.load(valid_ptr + slot, mask=ok, other=0) != 0)
        row_at = _pool_rows(slot, head, head_rows, H, HM)
        if KFOLD:
            s = _kivi_key_scores(q0, q1, q2, q3, kc_ptr, ks_ptr, km_ptr, table_ptr, row, W, t0, end, slot, row_at, ok,
                                 head, H, GP, D, KBITS, KTG, KPER, BS, BLOCK, OUT, NATIVE, PREC)
        else:
            k0, k1, k2, k3 = _decode_parts(kc_ptr, ks_ptr, km_ptr, slot, row_at, head, ok,
                                           KFMT, H, D, KBITS, KGROUP, KTG, KPER, BLOCK, KEX, NATIVE)
            s = tl.dot(q0, tl.trans(_operand(k0, KEX, OUT, NATIVE)), input_precision=PREC)
            if KPER > 1:
                s += tl.dot(q1, tl.trans(_operand(k1, KEX, OUT, NATIVE)), input_precision=PREC)
            if KPER > 2:
                s += tl.dot(q2, tl.trans(_operand(k2, KEX, OUT, NATIVE)), input_precision=PREC)
                s += tl.dot(q3, tl.trans(_operand(k3, KEX, OUT, NATIVE)), input_precision=PREC)
        s = tl.where(ok[None, :], s * key_scale, float("-inf"))  # [GP, BLOCK], log2 units
        if SCORES:
            tl.store(score_ptr + qrow[:, None] * total_cols + col0 + t[None, :], s, mask=gm[:, None] & inside[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if VEX:
            pm = _fp16(p, NATIVE)
        else:
            pm = _operand(p, False, OUT, NATIVE)
        v0, v1, v2, v3 = _decode_parts(vc_ptr, vs_ptr, vm_ptr, slot, row_at, head, ok,
                                       VFMT, H, D, VBITS, VGROUP, 1, VPER, BLOCK, VEX, NATIVE)
        acc0 = acc0 * alpha[:, None] + tl.dot(pm, _operand(v0, VEX, OUT, NATIVE), input_precision=PREC)
        if VPER > 1:
            acc1 = acc1 * alpha[:, None] + tl.dot(pm, _operand(v1, VEX, OUT, NATIVE), input_precision=PREC)
        if VPER > 2:
            acc2 = acc2 * alpha[:, None] + tl.dot(pm, _operand(v2, VEX, OUT, NATIVE), input_precision=PREC)
            acc3 = acc3 * alpha[:, None] + tl.dot(pm, _operand(v3, VEX, OUT, NATIVE), input_precision=PREC)
    at = qrow * total_splits + out_split
    tl.store(lse_ptr + at, tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf")), mask=gm)
    inv = _head_scale(vhs_ptr, row, head, VFMT, H) / tl.maximum(l_i, 1e-30)
    o = out_ptr + at[:, None] * D + VPER * tl.arange(0, DV)[None, :]
    tl.store(o, acc0 * inv[:, None], mask=gm[:, None])
    if VPER > 1:
        tl.store(o + 1, acc1 * inv[:, None], mask=gm[:, None])
    if VPER > 2:
        tl.store(o + 2, acc2 * inv[:, None], mask=gm[:, None])
        tl.store(o + 3, acc3 * inv[:, None], mask=gm[:, None])


@jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, final_lse_ptr, S, D: tl.constexpr, SP: tl.constexpr,
                  DP: tl.constexpr, OUT: tl.constexpr, CHUNK: tl.constexpr):
    """Combine the ``S`` partial results of one (row, query head) (see :func:`_merge_row`), for
    the ``DP`` output channels from ``program_id(1) * DP`` on. Slicing the channels over
    programs keeps the GPU busy when there are few rows and many splits (batch 1, long rows)."""
    _merge_row(part_ptr, lse_ptr, out_ptr, final_lse_ptr, tl.program_id(0).to(tl.int64), S, tl.program_id(1) * DP,
               D, SP, DP, OUT, CHUNK)


@jit
def _merge_row(part_ptr, lse_ptr, out_ptr, final_lse_ptr, qrow, S, first, D: tl.constexpr, SP: tl.constexpr,
               DP: tl.constexpr, OUT: tl.constexpr, CHUNK: tl.constexpr):
    """Combine the ``S`` partial results of query row ``qrow`` by their log2-sum-exp, for the
    ``DP`` output channels from ``first`` on: the weights from all ``S`` log-sum-exps at once,
    the outputs ``CHUNK`` splits at a time (a ``[S, D]`` tile in registers spilled from 64
    splits on); the row's merged log2-sum-exp is written by its first slice."""
    s = tl.arange(0, SP)
    lse = tl.load(lse_ptr + qrow * S + s, mask=s < S, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_safe), 0)
    c = tl.arange(0, CHUNK)
    d = first + tl.arange(0, DP)
    acc = tl.zeros([DP], tl.float32)
    for s0 in range(0, S, CHUNK):
        inside = s0 + c < S
        w = tl.exp2(tl.load(lse_ptr + qrow * S + s0 + c, mask=inside, other=float("-inf")) - m_safe)
        o = tl.load(part_ptr + (qrow * S + s0 + c[:, None]) * D + d[None, :], mask=inside[:, None] & (d[None, :] < D),
                    other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    store_out_tl(out_ptr + qrow * D + d, acc / tl.maximum(total, 1e-30), d < D, OUT)
    tl.store(final_lse_ptr + qrow, tl.where(total > 0, m_safe + tl.log2(tl.maximum(total, 1e-30)), float("-inf")),
             mask=first == 0)


@jit
def _rider_merge_kernel(q_ptr, part_ptr, lse_ptr, out_ptr, final_lse_ptr, S, qk_scale, sources,
                        CONSTS: tl.constexpr, NSRC: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                        GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, PREC: tl.constexpr,
                        OUT: tl.constexpr, NATIVE: tl.constexpr, CHUNK: tl.constexpr):
    """One query head ``program_id(1)`` of one (row, KV head) ``program_id(0)``: the partial
    attention of the short sources (the recent buffer), written where the merge reads it, then
    the merge of all ``S`` partial results of that query head, as :func:`_merge_kernel` merges
    one. Where the long sources run in a launch of their own (the CUDA kernel), this is the
    buffer's partial launch and the merge in one launch. Sources as in
    :func:`_paged_partial_kernel`, one split each.

    Each of the group's ``G`` programs computes the buffer's partials of the whole group (a few
    tiles) and writes them; the others write the same values to the same places, and each reads
    back only its own query head's after its own writes. A program per (row, KV head) merging its
    ``G`` query heads one after another took 19 µs per layer in ThinKV's decode step at batch 16
    and 8,192-token prompts (128 programs; H200, ``profile_decode_gpu.json``), more than twice
    the plain merge's time in earlier profiles of that step."""
    for i in tl.static_range(NSRC):
        src = sources[i]
        _source_partial(q_ptr, part_ptr, lse_ptr, part_ptr, src[0], src[1], src[2], src[3], src[4], src[5],
                        src[6], src[7], src[8], src[9], src[10], src[11], src[12], 0, 1, src[15], S, src[16], 0,
                        qk_scale, src[17], CONSTS[i][0], CONSTS[i][1], CONSTS[i][2], CONSTS[i][3], CONSTS[i][4],
                        CONSTS[i][5], CONSTS[i][6], CONSTS[i][7], CONSTS[i][8], CONSTS[i][9], CONSTS[i][10],
                        CONSTS[i][11], H, G, GP, D, CONSTS[i][12], CONSTS[i][13], CONSTS[i][14], CONSTS[i][15],
                        CONSTS[i][16], False, PREC, OUT, NATIVE)
    tl.debug_barrier()  # the partials this program wrote, visible to all its threads
    pid = tl.program_id(0)
    qrow = ((pid // H) * (H * G) + (pid % H) * G + tl.program_id(1)).to(tl.int64)
    _merge_row(part_ptr, lse_ptr, out_ptr, final_lse_ptr, qrow, S, 0, D, SP, D, OUT, CHUNK)


@jit
def _mass_kernel(logit_ptr, lse_ptr, table_ptr, valid_ptr, mass_ptr, weight_ptr, W, tokens, col0, total_cols,
                 HQ: tl.constexpr, HP: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr):
    """One tile of one row of one source: each valid slot's probability (its logit against the
    merged log2-sum-exp), averaged over the ``HQ`` query heads, times the row's weight, added
    to the slot's channel in place (a slot belongs to one row: no two programs write it)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < tokens
    blk = tl.load(table_ptr + row * W + t // BS, mask=inside, other=-1).to(tl.int64)
    slot = blk * BS + t % BS
    ok = inside & (blk >= 0)
    ok = ok & (tl.load(valid_ptr + slot, mask=ok, other=0) != 0)
    h = tl.arange(0, HP)
    hm = h < HQ
    lse = tl.load(lse_ptr + row * HQ + h, mask=hm, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a row with nothing valid: every logit is -inf
    logit = tl.load(logit_ptr + (row * HQ + h)[:, None] * total_cols + col0 + t[None, :],
                    mask=hm[:, None] & ok[None, :], other=float("-inf"))
    delta = tl.sum(tl.exp2(logit - lse[:, None]), 0) * (tl.load(weight_ptr + row) / HQ)
    current = tl.load(mass_ptr + slot, mask=ok, other=0.0)
    tl.store(mass_ptr + slot, current + delta, mask=ok)
