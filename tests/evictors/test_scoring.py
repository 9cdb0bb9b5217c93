"""Attention-importance, R-KV and H2O evictors against the loop-based references."""

from __future__ import annotations

import re

import pytest
import torch

import reference_scores as ref
from kvcompose import registry
from kvcompose.evictors import AttentionEvictor, EvictionContext, H2OEvictor, RKVEvictor

HKV, GROUP, D, W = 2, 3, 8, 6  # GQA: Hq = 3 * Hkv


def make_ctx(lengths, slots, *, seed=0, shuffle=True, causal=True, window_valid=None, keep=None) -> EvictionContext:
    """A batch whose row ``b`` holds ``lengths[b]`` live tokens in ``slots`` slots.

    Positions have gaps (as after earlier evictions); with ``shuffle`` the live tokens
    sit in random slots, so slot order is not position order. The recorded queries
    are those of each row's last ``W`` tokens, oldest first.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    keys = torch.randn(B, HKV, slots, D, generator=g)
    queries = torch.randn(B, HKV * GROUP, W, D, generator=g)
    # A few near-duplicate keys so the similarity threshold matters.
    keys[:, :, 1] = keys[:, :, 0] + 0.05 * torch.randn(B, HKV, D, generator=g)
    keys[:, :, 3] = keys[:, :, 0] + 0.05 * torch.randn(B, HKV, D, generator=g)
    positions = torch.full((B, slots), -1, dtype=torch.long)
    valid = torch.zeros(B, slots, dtype=torch.bool)
    query_positions = torch.zeros(B, W, dtype=torch.long)
    query_valid = torch.zeros(B, W, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pos = torch.sort(torch.randperm(3 * slots, generator=g)[:n]).values
        where = torch.randperm(slots, generator=g)[:n] if shuffle else torch.arange(n)
        positions[b, where] = pos
        valid[b, where] = True
        m = min(n, W)
        query_positions[b, W - m :] = pos[n - m :]
        query_valid[b, W - m :] = True
    if window_valid is not None:
        query_valid &= window_valid
    return EvictionContext(
        keys=keys,
        positions=positions,
        valid=valid,
        keep=torch.as_tensor(keep if keep is not None else [max(1, n // 2) for n in lengths]),
        protected=torch.zeros(B, slots, dtype=torch.bool),
        queries=queries,
        query_valid=query_valid,
        query_positions=query_positions if causal else None,
        scaling=D**-0.5,
    )


def row_alone(ctx: EvictionContext, b: int) -> EvictionContext:
    """Row ``b`` by itself, with only its live slots (in the same slot order)."""
    live = ctx.valid[b].nonzero().squeeze(1)
    return EvictionContext(
        keys=ctx.keys[b : b + 1, :, live],
        positions=ctx.positions[b : b + 1, live],
        valid=ctx.valid[b : b + 1, live],
        keep=ctx.keep[b : b + 1],
        protected=ctx.protected[b : b + 1, live],
        queries=ctx.queries[b : b + 1],
        query_valid=ctx.query_valid[b : b + 1],
        query_positions=None if ctx.query_positions is None else ctx.query_positions[b : b + 1],
        scaling=ctx.scaling,
        state={k: v[b : b + 1, live] for k, v in ctx.state.items()},
    )


def ref_kwargs(ev: AttentionEvictor, ctx: EvictionContext) -> dict:
    return dict(
        window=ev.window, gqa=ev.gqa, window_reduce=ev.window_reduce, pool=ev.pool,
        pool_width=ev.pool_width, query_positions=ctx.query_positions,
    )


def ref_args(ctx: EvictionContext) -> tuple:
    return ctx.keys, ctx.positions, ctx.valid, ctx.queries, ctx.query_valid, ctx.scaling


IMPORTANCE_CONFIGS = [
    dict(),  # R-KV defaults: α=8, GQA max, mean, max-pool 7
    dict(window=4, gqa="mean", window_reduce="sum", pool="avg", pool_width=7),  # RPC-style
    dict(window=3, gqa="mean", window_reduce="mean", pool="avg", pool_width=5),  # SnapKV-style
    dict(window=6, gqa="max", window_reduce="sum", pool="none"),
    dict(window=2, gqa="max", window_reduce="mean", pool="max", pool_width=3),
]


# ------------------------------------------------------------------ importance
@pytest.mark.parametrize("config", IMPORTANCE_CONFIGS)
@pytest.mark.parametrize("causal", [True, False])
def test_importance_matches_reference(config, causal):
    ctx = make_ctx([13, 7, 16], 16, seed=1, causal=causal)
    ev = AttentionEvictor(**config)
    expected = ref.head_mean(ref.importance(*ref_args(ctx), **ref_kwargs(ev, ctx)))
    torch.testing.assert_close(ev.scores(ctx), expected.float(), rtol=1e-5, atol=1e-7)


def test_importance_ignores_invalid_queries():
    mask = torch.tensor([[True, False, True, True, False, True]] * 2)
    ctx = make_ctx([10, 12], 14, seed=2, window_valid=mask)
    ev = AttentionEvictor(window=W, pool="none")
    before = ev.scores(ctx)
    ctx.queries[:, :, ~mask[0]] = 100.0 * torch.randn_like(ctx.queries[:, :, ~mask[0]])
    torch.testing.assert_close(ev.scores(ctx), before)
    expected = ref.head_mean(ref.importance(*ref_args(ctx), **ref_kwargs(ev, ctx)))
    torch.testing.assert_close(before, expected.float(), rtol=1e-5, atol=1e-7)


def test_causal_mask_hides_keys_newer_than_every_query():
    ctx = make_ctx([12], 12, seed=3, shuffle=False)
    ctx.query_positions[:] = ctx.positions[0, 8]  # the last 3 tokens are newer than every recorded query
    scores = AttentionEvictor(window=W, pool="none").scores(ctx)
    assert torch.all(scores[0, 9:] == 0) and torch.all(scores[0, :9] > 0)


def test_pooling_follows_positions_not_slots():
    ordered = make_ctx([11, 9], 12, seed=4, shuffle=False)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shuffled = EvictionContext(
        keys=ordered.keys[:, :, perm], positions=ordered.positions[:, perm], valid=ordered.valid[:, perm],
        keep=ordered.keep, protected=ordered.protected[:, perm], queries=ordered.queries,
        query_valid=ordered.query_valid, query_positions=ordered.query_positions, scaling=ordered.scaling,
    )
    for ev in (AttentionEvictor(), AttentionEvictor(pool="avg"), RKVEvictor()):
        torch.testing.assert_close(ev.scores(shuffled), ev.scores(ordered)[:, perm])


# ------------------------------------------------------------------------ R-KV
@pytest.mark.parametrize(
    "config",
    [
        dict(),  # the paper's defaults: λ=0.1, T=0.5, β=1
        dict(lam=0.3, threshold=0.2, keep_recent_similar=2, gqa="mean", pool="avg", window=4),
        dict(lam=0.0, threshold=-1.0, keep_recent_similar=3, pool="none"),
        dict(lam=0.5, threshold=0.9, keep_recent_similar=0, window_reduce="sum"),
    ],
)
def test_rkv_matches_reference(config):
    ctx = make_ctx([14, 6, 11], 14, seed=5)
    ev = RKVEvictor(**config)
    expected = ref.rkv(
        *ref_args(ctx), lam=ev.lam, threshold=ev.threshold, keep_recent_similar=ev.keep_recent_similar,
        **ref_kwargs(ev, ctx),
    )
    torch.testing.assert_close(ev.scores(ctx), expected.float(), rtol=1e-5, atol=1e-7)


def test_rkv_limits_are_importance_and_redundancy():
    ctx = make_ctx([10, 8], 10, seed=6)
    torch.testing.assert_close(RKVEvictor(lam=1.0).scores(ctx), AttentionEvictor().scores(ctx))
    red = ref.head_mean(ref.redundancy(ctx.keys, ctx.positions, ctx.valid, threshold=0.5, keep_recent_similar=1))
    torch.testing.assert_close(RKVEvictor(lam=0.0).scores(ctx), -red.float(), rtol=1e-5, atol=1e-7)


def test_rkv_spares_the_newest_copy_of_a_repeated_key():
    torch.manual_seed(0)
    L = 8
    keys = torch.linalg.qr(torch.randn(D, D)).Q[:L].reshape(1, 1, L, D).clone()  # orthogonal keys
    copies = [1, 4, 6]
    keys[0, 0, copies] = keys[0, 0, 1]
    ctx = EvictionContext(
        keys=keys, positions=torch.arange(L)[None], valid=torch.ones(1, L, dtype=torch.bool),
        keep=torch.tensor([L - 2]), protected=torch.zeros(1, L, dtype=torch.bool),
        queries=torch.randn(1, GROUP, 2, D), query_valid=torch.ones(1, 2, dtype=torch.bool),
    )
    red = RKVEvictor().head_redundancy(ctx)[0, 0]
    # 1 and 4 both have 6 as their newest look-alike and 6's newest is 4, so the
    # link counts are: 1 <- {4, 6}, 4 <- {1}, 6 <- {}: the newest copy is as unique
    # as a token with no look-alike, the oldest the most redundant.
    torch.testing.assert_close(red[6], red[0])
    assert red[1] > red[4] > red[6]
    keep = RKVEvictor(lam=0.0).select(ctx)[0]
    assert keep[6] and not keep[1] and not keep[4]


# ----------------------------------------------------- batch == single sequence
RPC_LIKE = AttentionEvictor(window=4, gqa="mean", window_reduce="sum", pool="avg")


@pytest.mark.parametrize("ev", [AttentionEvictor(), RPC_LIKE, RKVEvictor()])
def test_rows_score_as_if_alone(ev):
    ctx = make_ctx([15, 6], 16, seed=7, keep=[9, 3])
    batch_scores, batch_keep = ev.scores(ctx), ev.select(ctx)
    for b in range(2):
        alone = row_alone(ctx, b)
        live = ctx.valid[b].nonzero().squeeze(1)
        torch.testing.assert_close(batch_scores[b, live], ev.scores(alone)[0], rtol=1e-5, atol=1e-7)
        kept_batch = set(ctx.positions[b, batch_keep[b]].tolist())
        kept_alone = set(alone.positions[0, ev.select(alone)[0]].tolist())
        assert kept_batch == kept_alone and len(kept_batch) == int(ctx.keep[b])


# ---------------------------------------------------------------- selection
def test_selection_respects_protection_and_applies_in_position_order():
    ctx = make_ctx([16, 12], 16, seed=8, keep=[10, 9])
    ctx.protected = ctx.valid & (ctx.positions >= ctx.query_positions[:, :1])  # the observation window
    ev = RKVEvictor()
    keep = ev.select(ctx)
    scores = ev.scores(ctx)
    for b in range(2):
        assert (keep[b] & ~ctx.valid[b]).sum() == 0 and int(keep[b].sum()) == int(ctx.keep[b])
        assert bool(keep[b][ctx.protected[b]].all())
        # The rest of the budget goes to the best-scoring unprotected tokens.
        free = ctx.valid[b] & ~ctx.protected[b]
        n_free = int(ctx.keep[b]) - int(ctx.protected[b].sum())
        best = scores[b].masked_fill(~free, float("-inf")).topk(n_free).indices
        assert set(best.tolist()) == set((keep[b] & free).nonzero().squeeze(1).tolist())
        # Applying the mask the way a gathering pager does keeps tokens in position order.
        kept = keep[b].nonzero().squeeze(1)
        order = torch.argsort(ctx.positions[b, kept])
        kept_positions = ctx.positions[b, kept[order]]
        assert torch.all(kept_positions[1:] > kept_positions[:-1])
        torch.testing.assert_close(ctx.keys[b, :, kept[order]], ctx.keys[b][:, kept][:, order])


# ------------------------------------------------------------------------ H2O
def test_h2o_accumulates_attention_per_token_across_steps_and_evictions():
    """Simulate a store that carries the ``acc`` channel with each token through appends and evictions."""
    g = torch.Generator().manual_seed(9)
    ev = H2OEvictor()
    assert ev.needs_probs and ev.slot_channels == ("acc",) and ev.query_window == 0
    B, Hq, L = 2, HKV * GROUP, 12
    positions = torch.full((B, L), -1, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    acc = torch.zeros(B, L)
    steps, next_pos = [], [0, 0]
    for step in range(8):
        for b in range(B):  # append one token per row into a free slot (row 1 skips some steps)
            if b == 1 and step % 3 == 2:
                continue
            slot = int((~valid[b]).nonzero()[0])
            positions[b, slot], valid[b, slot], acc[b, slot] = next_pos[b], True, 0.0
            next_pos[b] += 1
        Lq = 3 if step == 0 else 1
        logits = torch.randn(B, Hq, Lq, L, generator=g).masked_fill(~valid[:, None, None], float("-inf"))
        probs = logits.softmax(-1)
        steps.append((probs, positions.clone(), valid.clone()))
        acc += ev.observe(probs, valid)["acc"]
        if step in (4, 6):
            ctx = EvictionContext(
                keys=torch.zeros(B, HKV, L, D), positions=positions, valid=valid,
                keep=valid.sum(1) - 2, protected=torch.zeros(B, L, dtype=torch.bool), state={"acc": acc},
            )
            keep = ev.select(ctx)
            totals = ref.h2o_totals(steps)
            for b in range(B):
                for s in valid[b].nonzero().squeeze(1).tolist():
                    assert acc[b, s].item() == pytest.approx(totals[(b, int(positions[b, s]))], rel=1e-5)
                # The two tokens with the least accumulated attention go.
                dropped = (valid[b] & ~keep[b]).nonzero().squeeze(1)
                worst = acc[b].masked_fill(~valid[b], float("inf")).topk(2, largest=False).indices
                assert set(dropped.tolist()) == set(worst.tolist())
            valid, acc = keep.clone(), torch.where(keep, acc, 0.0)
            positions = torch.where(keep, positions, -1)


def test_h2o_rows_score_as_if_alone():
    ctx = make_ctx([9, 4], 10, seed=10, keep=[5, 2])
    ctx.state = {"acc": torch.rand(2, 10) * ctx.valid}
    ev = H2OEvictor()
    for b in range(2):
        alone = row_alone(ctx, b)
        kept_alone = alone.positions[0, ev.select(alone)[0]]
        assert set(ctx.positions[b, ev.select(ctx)[b]].tolist()) == set(kept_alone.tolist())


def test_h2o_needs_its_channel():
    ctx = make_ctx([4], 4)
    with pytest.raises(ValueError, match="'acc'"):
        H2OEvictor().scores(ctx)
    with pytest.raises(ValueError, match="attn_probs"):
        H2OEvictor().observe(torch.zeros(1, 2, 3), ctx.valid)


# ---------------------------------------------------------- config and errors
def test_registry_round_trip_and_query_window():
    for spec in ({"name": "attention", "window": 32, "gqa": "mean", "window_reduce": "sum", "pool": "avg"},
                 {"name": "rkv", "lam": 0.2, "keep_recent_similar": 2}, {"name": "h2o"}):
        ev = registry.build("evictor", spec)
        again = registry.build("evictor", registry.to_config(ev))
        assert again == ev and again.query_window == ev.query_window
    assert registry.build("evictor", {"name": "attention", "window": 32}).query_window == 32
    assert RKVEvictor().query_window == 8 and RKVEvictor().pool_width == 7 and RKVEvictor().gqa == "max"


def test_missing_queries_is_a_clear_error():
    ctx = make_ctx([5], 5)
    ctx.queries = None
    with pytest.raises(ValueError, match="queries"):
        AttentionEvictor().scores(ctx)


@pytest.mark.parametrize(
    "cls, field, value, words",
    [
        (AttentionEvictor, "window", 0, ">= 1"),
        (AttentionEvictor, "window", True, ">= 1"),
        (AttentionEvictor, "gqa", "sum", "'max', 'mean'"),
        (AttentionEvictor, "window_reduce", "max", "'mean', 'sum'"),
        (AttentionEvictor, "pool", "median", "'max', 'avg', 'none'"),
        (AttentionEvictor, "pool_width", 6, "odd"),
        (AttentionEvictor, "pool_width", 0, ">= 1"),
        (AttentionEvictor, "head_reduce", "sum", "'mean', 'max'"),
        (RKVEvictor, "lam", 1.5, r"\[0, 1\]"),
        (RKVEvictor, "lam", "0.1", r"\[0, 1\]"),
        (RKVEvictor, "threshold", 2.0, r"\[-1, 1\]"),
        (RKVEvictor, "keep_recent_similar", -1, ">= 0"),
        (RKVEvictor, "pool_width", 4, "odd"),
    ],
)
def test_field_validation_names_value_and_range(cls, field, value, words):
    with pytest.raises(ValueError, match=field) as err:
        cls(**{field: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)
    assert re.search(words, str(err.value))


def test_scores_are_finite_with_empty_rows_and_bf16_keys():
    ctx = make_ctx([0, 5], 6, seed=11, keep=[0, 2])
    ctx.keys = ctx.keys.to(torch.bfloat16)
    ctx.queries = ctx.queries.to(torch.bfloat16)
    for ev in (AttentionEvictor(), RKVEvictor(), AttentionEvictor(pool="avg", gqa="mean")):
        s = ev.scores(ctx)
        assert s.dtype == torch.float32 and torch.isfinite(s).all() and torch.all(s[0] == 0)
        keep = ev.select(ctx)
        assert int(keep[0].sum()) == 0 and int(keep[1].sum()) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_logits_of_16_bit_cuda_inputs_are_the_fp32_products(dtype, monkeypatch):
    """The tensor-core product written in fp32 gives the fp32 product of the same 16-bit values
    (exact products, fp32 sums: only their order differs), with token-major keys as a view holds
    them; and the attention scores built on it keep the tokens the CPU keeps."""
    from kvcompose.evictors.attention import BMM_TO_FP32, window_logits

    assert BMM_TO_FP32, "this torch cannot write a 16-bit product in fp32; the scoring copies keys to fp32"
    g = torch.Generator().manual_seed(3)
    B, Hkv, G, W_, L, Dh = 3, 4, 4, 8, 300, 128
    q = torch.randn(B, Hkv, G, W_, Dh, generator=g).to(dtype).cuda()
    keys = torch.randn(B, L, Hkv, Dh, generator=g).to(dtype).cuda().transpose(1, 2)  # token-major, as a view's
    exact = torch.einsum("bhgwd,bhld->bhgwl", q.double(), keys.double())
    with monkeypatch.context() as m:  # the tensor-core path, not the fp32 einsum
        m.setattr(torch, "einsum", lambda *a, **k: pytest.fail("16-bit CUDA logits went through the fp32 einsum"))
        fast = window_logits(q, keys)
    assert fast.dtype == torch.float32 and fast.shape == (B, Hkv, G, W_, L)
    torch.testing.assert_close(fast.double(), exact, rtol=1e-5, atol=1e-4)
    ctx = make_ctx([5, 6], 6, seed=4, keep=[3, 4])
    ctx.keys, ctx.queries = ctx.keys.to(dtype), ctx.queries.to(dtype)
    evictors = (AttentionEvictor(), AttentionEvictor(pool="avg", gqa="mean"))
    on_cpu = [ev.select(ctx) for ev in evictors]
    for name in ("keys", "queries", "positions", "valid", "keep", "protected", "query_valid", "query_positions"):
        setattr(ctx, name, getattr(ctx, name).cuda())
    assert [ev.select(ctx).cpu().tolist() for ev in evictors] == [k.tolist() for k in on_cpu]
