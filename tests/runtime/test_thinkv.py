"""ThinKV: TBE step-downs on scripted segments, the segment trigger, and the policy end to end."""

import pytest
import torch

from conftest import greedy, left_padded, tiny_model, use_torch_references
from kvcompose import Policy
from kvcompose.evictors import EvictionContext, ThoughtEvictor
from kvcompose.evictors.tbe import step_down_over_budget
from kvcompose.triggers import SegmentEnd, TriggerInput

CLASSES = ("R", "E", "T")
TAU = 8


def _context(segment_types, prompt=4, budget=10_000, per_segment=TAU, seed=0):
    """One row: ``prompt`` prompt tokens then full segments of the given types (plus nothing open)."""
    n = prompt + per_segment * len(segment_types)
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(n)[None]
    classes = torch.tensor([0] * prompt + [CLASSES.index(t) for t in segment_types for _ in range(per_segment)])[None]
    return EvictionContext(
        keys=torch.randn(1, 2, n, 4, generator=g), positions=positions, valid=torch.ones(1, n, dtype=torch.bool),
        keep=torch.tensor([budget]), protected=torch.zeros(1, n, dtype=torch.bool), classes=classes,
        class_names=CLASSES, prompt_columns=prompt, segment=TAU,
    )


def _sizes(keep, n_segments, prompt=4):
    return [int(keep[0, prompt + s * TAU: prompt + (s + 1) * TAU].sum()) for s in range(n_segments)]


def test_transition_steps_every_earlier_segment_down_the_schedule():
    ev = ThoughtEvictor(retention=(4, 2, 1))
    keep = ev.select(_context("RET"))
    assert _sizes(keep, 3) == [4, 4, 8]  # R and E step to 4; the T segment itself stays
    assert bool(keep[0, :4].all())  # the prompt is never touched


def test_retention_schedule_is_followed_and_floors():
    ev = ThoughtEvictor(retention=(4, 2, 1))
    assert ev._next(torch.tensor([8, 4, 3, 2, 1])).tolist() == [4, 2, 2, 1, 1]


def test_no_transition_and_under_budget_keeps_everything():
    keep = ThoughtEvictor(retention=(4, 2)).select(_context("RER"))
    assert bool(keep.all())


def test_over_budget_shrinks_least_important_oldest_first():
    # prompt 4 + 4 segments of 8 = 36 tokens; budget 32 -> one step-down of the oldest E segment frees 4.
    keep = ThoughtEvictor(retention=(4, 2)).select(_context("RERE", budget=32))
    assert _sizes(keep, 4) == [8, 4, 8, 8]
    # budget 26: the oldest E segment goes down the whole schedule (8 -> 4 -> 2), then the next E (8 -> 4).
    keep = ThoughtEvictor(retention=(4, 2)).select(_context("RERE", budget=26))
    assert _sizes(keep, 4) == [8, 2, 8, 4]
    # budget 16: both E segments at the floor, then R segments, oldest first.
    keep = ThoughtEvictor(retention=(4, 2)).select(_context("RERE", budget=16))
    assert _sizes(keep, 4) == [2, 2, 4, 2]


def test_kmeans_keeps_one_token_per_cluster_of_keys():
    ctx = _context("RT")
    keys = torch.zeros(1, 2, ctx.keys.shape[2], 4)
    cluster = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    centers = torch.eye(4) * 10
    keys[0, :, 4:12] = centers[cluster][None] + 0.01 * torch.randn(2, 8, 4)
    ctx.keys = keys
    keep = ThoughtEvictor(retention=(4, 2)).select(ctx)
    kept = cluster[keep[0, 4:12]]
    assert sorted(kept.tolist()) == [0, 1, 2, 3]


def test_segment_trigger_fires_at_segment_ends():
    t = SegmentEnd()
    counts = TriggerInput(stored=torch.tensor([40, 40, 40]), prompt=torch.tensor([8, 8, 8]),
                          generated=torch.tensor([0, 16, 17]), budget=32, segment=16)
    assert t.fires(counts, t.plan(counts)).tolist() == [False, True, False]
    assert t.plan(counts).tolist() == [32, 32, 32]


@pytest.mark.parametrize("bad", [{"retention": [4, 8]}, {"retention": []}, {"kmeans_iters": -1}])
def test_tbe_fields_are_validated(bad):
    with pytest.raises(ValueError, match="tbe evictor"):
        ThoughtEvictor(**bad)


def _small_thinkv(**overrides):
    config = dict(
        refresh=16, budget=48,
        classifier={"name": "sparsity_kde", "thresholds": [0.2, 0.6], "layers": [0, 1]},
        evictor={"name": "tbe", "retention": [8, 4, 2]},
    )
    config.update(overrides)
    return Policy.from_preset("thinkv", **config)


def test_thinkv_end_to_end_batch_parity_ct_and_report(monkeypatch):
    # The quantizers and TBE's k-means run inside a cache in tests/quantizers/test_codec.py and
    # tests/hf/test_static_decode.py; here their references keep a 96-token run short.
    use_torch_references(monkeypatch, kmeans=True)
    model = tiny_model("llama", heads=2, kv_heads=1)  # head dim 32
    policy = _small_thinkv()
    prompts, ids, mask = left_padded([20, 37])
    cache = policy.make_cache(model)
    batch = greedy(model, ids, mask, 96, cache=cache)
    for i, p in enumerate(prompts):
        alone = greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long), 96, cache=policy.make_cache(model))
        assert torch.equal(batch[i], alone[0]), f"row {i} differs from its single run"
    r = cache.report()
    assert r.refreshes == 1 + 95 // 16
    assert abs(sum(r.thought_mix.values()) - 100.0) < 1e-6
    assert 2.5 <= r.avg_bits <= 4.5
    assert 0 < r.eviction_call_rate <= 100 * 5 / 96 + 1e-9  # at most one eviction step per segment end
    assert r.kv_bytes < r.full_kv_bytes
    # Kept tokens stay within the budget plus the open segment and the buffer; ct evicted in place.
    assert max(max(row) for row in r.tokens_kept) <= 48 + 16 + 15
    assert any(region.has_holes for layer in cache.layers for region in layer.store.regions)


def test_thinkv_variants_and_config_round_trip():
    for name in ("thinkv", "thinkv-tbq", "thinkv-tbe"):
        p = Policy.from_preset(name)
        assert Policy.from_config(p.to_config()) == p
    assert Policy.from_preset("thinkv-tbq").evictor is None
    assert all(q is None for q in Policy.from_preset("thinkv-tbe").precision.values())


def test_classifier_classes_must_be_mapped():
    with pytest.raises(ValueError, match=r"emits classes \['T'\] that Policy.precision does not map"):
        Policy(precision={"R": "nvfp4", "E": "nvfp4"},
               classifier={"name": "sparsity_kde", "thresholds": [0.2, 0.6], "layers": [0]})


def test_protected_tokens_survive_step_downs():
    ctx = _context("RT")
    ctx.protected[0, 4:12] = True  # protect the whole R segment
    keep = ThoughtEvictor(retention=(4, 2)).select(ctx)
    assert _sizes(keep, 2) == [8, 8]


def test_a_new_calibration_replaces_the_presets_calibrated_values(tmp_path):
    import json

    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"model": "mine", "num_types": 3, "types": ["E", "R", "T"], "thresholds": [0.3, 0.7],
                                "layers": [1, 2], "mode_counts": {}, "fallback": None}))
    p = Policy.from_preset("thinkv", classifier={"calibration": str(path)})
    assert list(p.classifier.thresholds) == [0.3, 0.7] and list(p.classifier.layers) == [1, 2]


def _step_down_by_rounds(tbe, target, closed, importance, n_classes, held, keep):
    """Case 2 as the paper words it: one step-down per round, least important oldest first."""
    S = target.shape[1]
    idx = torch.arange(S)
    target, held = target.clone(), held.clone()
    for _ in range(S * len(tbe.retention)):
        shrinkable = closed & (tbe._next(target) < target) & (held > keep)[:, None]
        if not bool(shrinkable.any()):
            break
        key = torch.where(shrinkable, (n_classes + 1 - importance) * S + idx[None, :], torch.iinfo(torch.long).max)
        pick = key.argmin(1)
        cur = target.gather(1, pick[:, None])[:, 0]
        new = torch.where(shrinkable.any(1), tbe._next(cur), cur)
        held = held - (cur - new)
        target = target.scatter(1, pick[:, None], new[:, None])
    return target


def test_over_budget_step_downs_equal_the_round_by_round_rule():
    from kvcompose.evictors.tbe import ThoughtEvictor

    tbe = ThoughtEvictor(retention=(64, 32, 16, 8, 4))
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        B, S = 3, int(torch.randint(1, 9, (1,), generator=g))
        sizes = torch.tensor([128, 64, 32, 16, 8, 4, 100, 50, 3, 0])
        target = sizes[torch.randint(0, len(sizes), (B, S), generator=g)]
        closed = torch.rand(B, S, generator=g) < 0.8
        importance = torch.randint(-1, 3, (B, S), generator=g)
        held = target.sum(1) + torch.randint(0, 40, (B,), generator=g)
        keep = torch.randint(0, int(held.max()) + 1, (B,), generator=g)
        expected = _step_down_by_rounds(tbe, target, closed, importance, 3, held, keep)
        order_key = (3 + 1 - importance) * S + torch.arange(S)[None, :]  # as select builds it
        got = step_down_over_budget(target, closed, order_key, held, keep, *tbe._tables(target.device))
        assert torch.equal(got, expected), (trial, target, closed, importance, held, keep, got, expected)
