"""The attention of one layer over what its store keeps.

Decode steps read the store in place through the fused paged kernel
(:func:`paged_attention`); prefill, eviction steps and observed steps attend over the
dense view (:func:`dense_attention`). Evictors that accumulate attention (H2O) get the
probabilities from either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.paged_attention import paged_decode_attention


def paged_attention(layer, query, positions, scaling):
    """The fused decode attention over the store's blocks and buffer (no dense view)."""
    evictor = layer.cache.policy.evictor
    backend = layer.cache.attention_backend
    heads = layer.cache.heads
    if evictor is not None and evictor.mass_channel is not None:
        sources, channels = layer.store.attention_sources_with(evictor.mass_channel)
        weight = (positions[:, -1] >= 0).float()  # padding queries add nothing
        before = [c.clone() for c in channels] if heads.sharded else []
        out = paged_decode_attention(query, sources, scaling, mass=(channels, weight), backend=backend)
        for channel, old in zip(channels, before):  # this rank's heads' mean -> the mean over every rank's
            channel.copy_(old + over_ranks(heads, channel - old))
        return out
    sources = layer.store.attention_sources()
    if evictor is None or not evictor.needs_probs:
        return paged_decode_attention(query, sources, scaling, backend=backend)
    out, probs = paged_decode_attention(query, sources, scaling, probs=True, backend=backend)
    probs = probs[:, :, None, :] * (positions >= 0)[:, None, :, None]  # padding queries receive nothing
    _, valid, _ = layer.store.slot_state()
    for name, d in (evictor.observe(probs, valid) or {}).items():
        layer.store.add_to_slots(name, over_ranks(heads, d))
    return out


def dense_attention(layer, query, view, positions, scaling):
    """SDPA over the dense view, or explicit probabilities when the evictor accumulates them."""
    policy = layer.cache.policy
    store = layer.store
    mask = view.valid[:, None, None, :] & (view.positions[:, None, None, :] <= positions[:, None, :, None])
    # Padding queries see nothing; let them attend anywhere (their output is never used).
    mask = mask | ~mask.any(-1, keepdim=True)
    if policy.evictor is not None and policy.evictor.needs_probs:
        out, delta = _attention_observed(query, view, mask, positions, scaling, policy.evictor.observe)
        for name, d in delta.items():
            store.add_to_channel(name, view, over_ranks(layer.cache.heads, d))
    else:
        out = F.scaled_dot_product_attention(
            query, view.keys, view.values, attn_mask=mask, scale=scaling,
            enable_gqa=query.shape[1] != view.keys.shape[1],
        )
    return out


def over_ranks(heads, delta: torch.Tensor) -> torch.Tensor:
    """An evictor's per-slot increment, a mean over this rank's heads (the :meth:`Evictor.observe`
    contract), as the mean over the heads of every tensor-parallel rank (each holds as many)."""
    if not heads.sharded:
        return delta
    return heads.all_sum(delta.contiguous()) / heads.size


#: fp32 probabilities an accumulating evictor's attention holds at once (see :func:`_attention_observed`).
PROBS_CHUNK_BYTES = 256 * 2**20


def _attention_observed(query, view, mask, positions, scaling, observe):
    """Plain attention for evictors that accumulate what it gives (``h2o``): the output and the
    summed per-slot increments ``observe`` makes of the probabilities. The queries go in chunks
    whose fp32 probabilities take at most :data:`PROBS_CHUNK_BYTES` (with the logits and the
    cast for the values about 2.5 times that): whole, a prefill's would take ``B x Hq x T x L x 4``
    bytes per layer (8.6 GB per row at 8K tokens and 32 query heads), several times over.
    ``observe`` is additive over queries (the :meth:`Evictor.observe` contract)."""
    B, Hq, T, _ = query.shape
    group = Hq // view.keys.shape[1]
    k = view.keys.repeat_interleave(group, dim=1)
    v = view.values.repeat_interleave(group, dim=1)
    rows = max(1, PROBS_CHUNK_BYTES // (B * Hq * k.shape[2] * 4))
    outs, total = [], {}
    for s in range(0, T, rows):
        logits = (query[:, :, s:s + rows] @ k.transpose(-1, -2)).float() * scaling
        probs = logits.masked_fill_(~mask[:, :, s:s + rows], float("-inf")).softmax(-1)
        outs.append(probs.to(v.dtype) @ v)
        probs *= (positions[:, s:s + rows] >= 0)[:, None, :, None]  # padding queries receive nothing
        for name, d in (observe(probs, view.valid) or {}).items():
            total[name] = total[name] + d if name in total else d
    return torch.cat(outs, dim=2), total
