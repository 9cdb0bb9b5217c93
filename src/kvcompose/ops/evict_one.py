"""Evict at most one token per row, in place: the per-step eviction of over-budget policies.

Under an ``over_budget`` trigger a decode step adds one token per row, so a row that was
at its budget holds one token too many and drops exactly one. For evictors that score from
positions (StreamingLLM's window) or from one slot channel (H2O's accumulated attention),
that choice needs no sort: the token to drop is the unprotected live token with the lowest
score, the oldest among equal scores (what :func:`~kvcompose.evictors.base.keep_top`
drops when it keeps all but one). Protection is the policy's: the ``sinks`` oldest and the
``recent`` newest live tokens (found as position thresholds by bisection over counts),
and optionally the prompt; when every live token is protected the oldest goes.

One program per row reads the row's pool slots through its block table and its recent
buffer, picks the token, and drops it where it lies: a pool slot loses its live bit (a
hole that the next group refills), a buffer slot is closed up by shifting the newer
buffer tokens one slot down. No host synchronization and fixed shapes, so the static
decode path runs it inside its captured step. A row asked to drop more than one token
sets ``bad`` (the caller's invariant is broken).

:func:`evict_one_in_place_torch` is the plain-torch reference (ranks by sorting).
"""

from __future__ import annotations

import torch

from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl

BUFFER_CHANNELS = ("k", "v", "pos", "valid", "cls")  # plus, optionally, one float slot channel


@jit
def _evict_one_kernel(table_ptr, W, pool_pos_ptr, pool_valid_ptr, pool_chan_ptr,
                      k_ptr, v_ptr, bpos_ptr, bvalid_ptr, bcls_ptr, bchan_ptr, blen_ptr,
                      evicted_ptr, bad_ptr, budget, sinks, recent, prompt_columns,
                      CAP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_HD: tl.constexpr, HAS_CHAN: tl.constexpr,
                      SCORE_CHAN: tl.constexpr, PROTECT_PROMPT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    big = 9223372036854775807
    # Pool columns of this row, then its buffer columns.
    offs = tl.arange(0, BLOCK_P)
    inp = offs < W * BS
    blk = tl.load(table_ptr + b * W + offs // BS, mask=inp, other=-1)
    slot = blk * BS + offs % BS
    pvalid = inp & (blk >= 0) & (tl.load(pool_valid_ptr + slot, mask=inp & (blk >= 0), other=0) != 0)
    ppos = tl.where(pvalid, tl.load(pool_pos_ptr + slot, mask=pvalid, other=-1), big)
    c = tl.arange(0, BLOCK_C)
    inc = c < CAP
    bvalid = inc & (tl.load(bvalid_ptr + b * CAP + c, mask=inc, other=0) != 0)
    bpos = tl.where(bvalid, tl.load(bpos_ptr + b * CAP + c, mask=bvalid, other=-1), big)
    live = tl.sum(pvalid.to(tl.int32), 0) + tl.sum(bvalid.to(tl.int32), 0)
    excess = live - budget
    tl.atomic_max(bad_ptr, 1, mask=excess > 1)
    lo_all = tl.minimum(tl.min(ppos, 0), tl.min(bpos, 0))
    hi_all = tl.maximum(tl.max(tl.where(pvalid, ppos, -1), 0), tl.max(tl.where(bvalid, bpos, -1), 0))
    # Sinks: live tokens at or below the smallest position p with `sinks` live tokens <= p.
    lo = lo_all
    hi = hi_all
    while lo < hi:
        mid = lo + (hi - lo) // 2
        n = tl.sum((ppos <= mid).to(tl.int32), 0) + tl.sum((bpos <= mid).to(tl.int32), 0)
        if n >= sinks:
            hi = mid
        else:
            lo = mid + 1
    sink_at = tl.where(sinks > 0, lo, -1)
    # Recent: live tokens at or above the largest position p with `recent` live tokens >= p.
    lo = lo_all
    hi = hi_all
    while lo < hi:
        mid = hi - (hi - lo) // 2
        n = tl.sum((pvalid & (ppos >= mid)).to(tl.int32), 0) + tl.sum((bvalid & (bpos >= mid)).to(tl.int32), 0)
        if n >= recent:
            lo = mid
        else:
            hi = mid - 1
    recent_from = tl.where(recent > 0, lo, big)
    p_prot = (ppos <= sink_at) | (ppos >= recent_from)
    b_prot = (bpos <= sink_at) | (bpos >= recent_from)
    if PROTECT_PROMPT:
        p_prot = p_prot | (ppos < prompt_columns)
        b_prot = b_prot | (bpos < prompt_columns)
    if SCORE_CHAN:
        p_score = tl.load(pool_chan_ptr + slot, mask=pvalid, other=0.0)
        b_score = tl.load(bchan_ptr + b * CAP + c, mask=bvalid, other=0.0)
    else:
        p_score = ppos.to(tl.float32)
        b_score = bpos.to(tl.float32)
    inf = float("inf")
    p_key = tl.where(pvalid, tl.where(p_prot, inf, p_score), inf)
    b_key = tl.where(bvalid, tl.where(b_prot, inf, b_score), inf)
    lowest = tl.minimum(tl.min(p_key, 0), tl.min(b_key, 0))
    oldest = tl.minimum(tl.min(tl.where(pvalid & (p_key == lowest), ppos, big), 0),
                        tl.min(tl.where(bvalid & (b_key == lowest), bpos, big), 0))
    fire = (excess > 0) & (oldest < big)
    # Drop it: a pool slot loses its live bit; a buffer slot is closed up.
    hit = tl.max(tl.where(pvalid & (ppos == oldest) & fire, slot, -1), 0)
    tl.store(pool_valid_ptr + hit, 0, mask=hit >= 0)
    tl.store(pool_pos_ptr + hit, -1, mask=hit >= 0)
    e = tl.max(tl.where(bvalid & (bpos == oldest) & fire, c, -1), 0)
    hd = tl.arange(0, BLOCK_HD)
    in_hd = hd < HD
    e_hd = e + hd * 0  # scalar masks broadcast to vectors as vectors (the interpreter needs it)
    for j in range(0, CAP - 1):
        move = (e >= 0) & (e <= j)
        move_hd = in_hd & (e_hd >= 0) & (e_hd <= j)
        row = (b * CAP + j) * HD
        tl.store(k_ptr + row + hd, tl.load(k_ptr + row + HD + hd, mask=move_hd), mask=move_hd)
        tl.store(v_ptr + row + hd, tl.load(v_ptr + row + HD + hd, mask=move_hd), mask=move_hd)
        at = b * CAP + j
        tl.store(bpos_ptr + at, tl.load(bpos_ptr + at + 1, mask=move), mask=move)
        tl.store(bvalid_ptr + at, tl.load(bvalid_ptr + at + 1, mask=move), mask=move)
        tl.store(bcls_ptr + at, tl.load(bcls_ptr + at + 1, mask=move), mask=move)
        if HAS_CHAN:
            tl.store(bchan_ptr + at, tl.load(bchan_ptr + at + 1, mask=move), mask=move)
    last = b * CAP + CAP - 1
    closing = e >= 0
    closing_hd = in_hd & (e_hd >= 0)
    tl.store(k_ptr + last * HD + hd, tl.zeros([BLOCK_HD], dtype=k_ptr.dtype.element_ty), mask=closing_hd)
    tl.store(v_ptr + last * HD + hd, tl.zeros([BLOCK_HD], dtype=v_ptr.dtype.element_ty), mask=closing_hd)
    tl.store(bpos_ptr + last, -1, mask=closing)
    tl.store(bvalid_ptr + last, 0, mask=closing)
    tl.store(bcls_ptr + last, 0, mask=closing)
    if HAS_CHAN:
        tl.store(bchan_ptr + last, 0.0, mask=closing)
    length = tl.load(blen_ptr + b)
    tl.store(blen_ptr + b, length - 1, mask=closing)
    tl.store(evicted_ptr + b, ((hit >= 0) | closing).to(tl.int8))


def _check(table, pool: dict, buffer: dict, score_channel: str | None) -> None:
    missing = [n for n in ("pos", "valid") if n not in pool] + [n for n in BUFFER_CHANNELS if n not in buffer]
    if score_channel is not None and (score_channel not in pool or score_channel not in buffer):
        missing.append(score_channel)
    if missing:
        raise ValueError(f"evict_one_in_place: missing slot channel(s) {missing}")
    extra = sorted(set(buffer) - set(BUFFER_CHANNELS) - {score_channel})
    if extra:
        raise ValueError(f"evict_one_in_place: buffer channel(s) {extra} are not moved by this op; "
                         f"it moves {list(BUFFER_CHANNELS)} and the score channel only")
    B, cap = buffer["pos"].shape
    if table.dim() != 2 or table.shape[0] != B or buffer["k"].shape[:2] != (B, cap):
        raise ValueError(f"evict_one_in_place: table {tuple(table.shape)} and buffer {tuple(buffer['k'].shape)} "
                         f"must share the batch ({B} rows, {cap} buffer slots)")


def evict_one_in_place(table: torch.Tensor, block_size: int, pool: dict, buffer: dict, buf_len: torch.Tensor, *,
                       budget: int, sinks: int, recent: int, prompt_columns: int, protect_prompt: bool,
                       score_channel: str | None, bad: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """Drop, in each row holding more than ``budget`` live tokens, its lowest-scoring unprotected
    token (see the module doc); returns ``[B]`` bool, True where a row dropped one.

    ``table`` ``[B, W]``: the pool's block ids per row; ``pool``: flat per-slot tensors ``pos``
    (int64), ``valid`` (bool) and the score channel (fp32) when ``score_channel`` is set (else
    the score is the position); ``buffer``: ``k``/``v`` ``[B, cap, H, D]``, ``pos``, ``valid``,
    ``cls`` and the score channel, ``[B, cap]``; ``buf_len`` ``[B]``. Written in place.
    ``bad``: an int32 flag set where a row holds more than ``budget + 1``. ``backend``: None
    (Triton on CUDA, the torch reference elsewhere), ``"triton"`` (CUDA, or the interpreter
    under ``TRITON_INTERPRET=1``), ``"torch"``."""
    _check(table, pool, buffer, score_channel)
    if not step_kernel_runs(table, _evict_one_kernel, backend):
        return evict_one_in_place_torch(table, block_size, pool, buffer, buf_len, budget=budget, sinks=sinks,
                                        recent=recent, prompt_columns=prompt_columns, protect_prompt=protect_prompt,
                                        score_channel=score_channel, bad=bad)
    B, cap = buffer["pos"].shape
    hd = buffer["k"][0, 0].numel()
    evicted = torch.zeros(B, dtype=torch.int8, device=table.device)
    chan = score_channel is not None
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 - bool pointers as bytes
    _evict_one_kernel[(B,)](
        table.contiguous(), table.shape[1], pool["pos"], as_bytes(pool["valid"]),
        pool[score_channel] if chan else pool["pos"],
        buffer["k"], buffer["v"], buffer["pos"], as_bytes(buffer["valid"]), buffer["cls"],
        buffer[score_channel] if chan else buffer["pos"], buf_len, evicted, bad,
        budget, sinks, recent, prompt_columns,
        CAP=cap, HD=hd, BS=block_size, BLOCK_P=next_pow2(max(table.shape[1] * block_size, 16)),
        BLOCK_C=next_pow2(max(cap, 2)), BLOCK_HD=next_pow2(hd), HAS_CHAN=chan, SCORE_CHAN=chan,
        PROTECT_PROMPT=protect_prompt, num_warps=4,
    )
    return evicted.bool()


def evict_one_in_place_torch(table, block_size, pool, buffer, buf_len, *, budget, sinks, recent, prompt_columns,
                             protect_prompt, score_channel, bad) -> torch.Tensor:
    """Reference of :func:`evict_one_in_place`: protection from sorted ranks, as
    :meth:`Policy.protected` computes it, and the same choice and drop (fixed shapes)."""
    B, cap = buffer["pos"].shape
    bs = block_size
    cols = torch.arange(table.shape[1] * bs, device=table.device)
    blk = table[:, cols // bs]
    slots = torch.where(blk >= 0, blk * bs + cols % bs, 0)
    pvalid = (blk >= 0) & pool["valid"][slots]
    valid = torch.cat([pvalid, buffer["valid"]], 1)
    pos = torch.where(valid, torch.cat([pool["pos"][slots], buffer["pos"]], 1), -1)
    if score_channel is None:
        score = pos.to(torch.float32)
    else:
        score = torch.cat([pool[score_channel][slots], buffer[score_channel]], 1)
    live = valid.sum(1)
    bad |= (live - budget > 1).any().to(bad.dtype)
    big = torch.iinfo(torch.long).max
    age = torch.argsort(torch.argsort(torch.where(valid, pos, big), dim=1), dim=1)
    protected = (age < sinks) | (age >= (live - recent)[:, None])
    if protect_prompt:
        protected |= pos < prompt_columns
    key = torch.where(valid & ~protected, score, float("inf"))
    key = torch.where(valid, key, float("inf"))
    lowest = key.amin(1, keepdim=True)
    oldest = torch.where(valid & (key == lowest), pos, big).amin(1, keepdim=True)
    hit = valid & (pos == oldest) & (live > budget)[:, None]
    p_hit = hit[:, :slots.shape[1]]
    dropped = torch.zeros_like(pool["pos"]).index_add_(0, slots.reshape(-1), p_hit.reshape(-1).long()) > 0
    pool["valid"] &= ~dropped
    pool["pos"].masked_fill_(dropped, -1)
    b_hit = hit[:, slots.shape[1]:]
    e = torch.where(b_hit.any(1), b_hit.float().argmax(1), cap)  # cap: nothing to close up
    j = torch.arange(cap, device=table.device)
    source = (j[None, :] + (j[None, :] >= e[:, None]).long()).clamp(max=cap - 1)
    emptied = (j[None, :] == cap - 1) & (e[:, None] < cap)
    fills = {"pos": -1}
    for name in (*BUFFER_CHANNELS, *([score_channel] if score_channel else [])):
        t = buffer[name]
        index = source.view(B, cap, *[1] * (t.dim() - 2)).expand_as(t)
        moved = t.gather(1, index)
        t.copy_(torch.where(emptied.view(B, cap, *[1] * (t.dim() - 2)), fills.get(name, 0), moved))
    buf_len -= (e < cap).long()
    return hit.any(1)
