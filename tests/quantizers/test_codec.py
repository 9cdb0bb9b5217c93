"""Quantized storage in the paged store: encode once, exact moves, honest bytes, presets end to end."""

import pytest
import torch

from conftest import greedy, left_padded, tiny_model
from kvcompose import Policy
from kvcompose.pagers import GatherPager
from kvcompose.quantizers import NVFP4Quantizer

H, D = 2, 32


def _store(policy, batch=2):
    return policy.make_store(batch, H, D, torch.float32, torch.device("cpu"))


def _tokens(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def test_tokens_are_quantized_once_and_never_again(monkeypatch):
    policy = Policy(precision={"all": "nvfp4"}, group_size=4, block_size=8)
    store = _store(policy)
    encoded = []
    original = NVFP4Quantizer.quantize

    def counting(self, x, **kw):
        encoded.append(x.shape[0])
        return original(self, x, **kw)

    monkeypatch.setattr(NVFP4Quantizer, "quantize", counting)
    k, v = _tokens(2, 10)
    store.append(k, v)
    pool = store.regions[0].pool
    first = {n: t.clone() for n, t in pool.slots.items()}
    for step in range(9):
        k1, v1 = _tokens(2, 1, seed=step + 1)
        store.append(k1, v1)
    # Every token that left the buffer was encoded exactly once (keys and values: two calls per flush).
    in_blocks = int(store.regions[0].length.sum())
    assert sum(encoded) == 2 * in_blocks
    # The first flushed blocks still hold the very same bytes.
    for n, t in first.items():
        assert torch.equal(pool.slots[n][: t.shape[0]], t)


def test_bytes_held_are_the_compressed_bytes():
    policy = Policy(precision={"all": "nvfp4"}, group_size=16, block_size=16)
    store = _store(policy, batch=1)
    k, v = _tokens(1, 64)
    store.append(k, v)
    mem = store.memory()
    # NVFP4: D/2 code bytes + D/16 scale bytes per head and token = 4.5 bits per value.
    assert mem["payload"] == 64 * 2 * H * (D // 2 + D // 16)
    assert 8 * mem["payload"] / (64 * 2 * H * D) == pytest.approx(4.5)
    assert mem["full"] == 64 * 2 * H * D * 4
    assert mem["in_use"] < mem["full"]


def test_compaction_moves_quantized_slots_exactly():
    policy = Policy(precision={"all": "nvfp4"}, group_size=4, block_size=4)
    store = _store(policy)
    k, v = _tokens(2, 23)
    store.append(k, v)
    before = store.view()
    keep = before.valid & (torch.rand(before.valid.shape, generator=torch.Generator().manual_seed(3)) < 0.6)
    GatherPager().compact(store, before, keep)
    after = store.view()
    for b in range(2):
        old = dict(zip(before.positions[b][keep[b]].tolist(), before.keys[b][:, keep[b]].unbind(1)))
        new = dict(zip(after.positions[b][after.valid[b]].tolist(), after.keys[b][:, after.valid[b]].unbind(1)))
        assert old.keys() == new.keys()
        assert all(torch.equal(old[p], new[p]) for p in old)


def test_precision_map_stores_each_class_in_its_format():
    policy = Policy(precision={"R": "nvfp4", "T": "ternary", "X": None}, group_size=4, block_size=4)
    store = _store(policy, batch=1)
    k, v = _tokens(1, 24)
    cls = torch.tensor([[0, 1, 2] * 8])
    store.append(k, v, cls=cls)
    view = store.view()
    live = view.valid[0]
    err = {}
    for index, name in enumerate(policy.classes):
        at = live & (view.region[0] == index)
        pos = view.positions[0][at]
        assert bool((cls[0, pos] == index).all())
        err[name] = ((view.keys[0][:, at] - k[0][:, pos]).norm() / k[0][:, pos].norm()).item()
    assert err["X"] == 0.0  # full precision
    assert 0 < err["R"] < err["T"]  # 4.5-bit NVFP4 beats 2.5-bit ternary
    assert store.regions[0].pool is not store.regions[1].pool


@pytest.mark.parametrize("preset", ["fp8", "nvfp4", "kivi2", "kivi4"])
def test_quantized_presets_generate_and_batch_rows_equal_single_runs(preset):
    model = tiny_model("llama", heads=2, kv_heads=1)  # head dim 32: a multiple of every block size
    policy = Policy.from_preset(preset)
    prompts, ids, mask = left_padded([40, 150, 70])
    batch = greedy(model, ids, mask, 40, cache=policy.make_cache(model))
    for i, p in enumerate(prompts):
        alone = greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long), 40, cache=policy.make_cache(model))
        assert torch.equal(batch[i], alone[0])


def test_quantized_store_with_eviction():
    model = tiny_model("llama", heads=2, kv_heads=1)
    policy = Policy.from_preset("streamingllm", budget=48, precision={"all": "nvfp4"})
    _, ids, mask = left_padded([30, 60])
    cache = policy.make_cache(model)
    greedy(model, ids, mask, 50, cache=cache)
    assert cache.report().tokens_kept == [[48, 48]] * 2


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"precision": {"all": "kivi"}}, "known quantizers"),
        ({"precision": {}}, "must map token classes"),
        ({"precision": {"all": {"name": "int", "layout": "kivi"}}, "group_size": 16}, "multiples of 32"),
        ({"scale_headroom": 0.5}, "scale_headroom must be a number >= 1"),
    ],
)
def test_bad_precision_settings_are_named(overrides, match):
    with pytest.raises((ValueError, KeyError), match=match):
        Policy(**overrides)


def test_shared_scale_formats_refuse_eviction():
    with pytest.raises(ValueError, match="cannot be compacted after eviction"):
        Policy.from_preset("streamingllm", precision={"all": {"name": "int", "layout": "kivi"}},
                           group_size=32, block_size=32)


@pytest.mark.parametrize("fmt", ["fp8", "kivi2"])
def test_bad_values_are_recorded_at_encode_and_raised_by_check_errors(fmt):
    """Encoding does not wait for the device to say whether its input was finite: the store
    raises at its next check (the cache checks once per forward pass)."""
    from kvcompose.ops.quant_fp8 import _fp8_quantize_kernel
    from kvcompose.ops.triton_shim import interpreted

    if not interpreted(_fp8_quantize_kernel):
        pytest.skip("kernels were defined without TRITON_INTERPRET=1")
    policy = Policy.from_preset(fmt) if fmt == "kivi2" else Policy(precision={"all": fmt}, group_size=4, block_size=8)
    store = _store(policy, batch=1)
    k, v = _tokens(1, 300)
    store.append(k, v)
    store.check_errors()  # finite input: nothing recorded
    k, v = _tokens(1, 200, seed=3)
    k[0, 1, 5, 7] = float("nan")
    store.append(k, v)  # the NaN token leaves the buffer and is encoded: recorded, not raised
    with pytest.raises(ValueError, match="kvcompose store: the model produced NaN/inf keys or values"):
        store.check_errors()
    store.check_errors()  # reported once (the codec's record of the same values is cleared)


def test_cache_raises_recorded_errors_at_the_next_forward(monkeypatch):
    """The cache reads every layer's error flags with one synchronization per forward pass and
    raises what an encode recorded."""
    model = tiny_model("llama", heads=2, kv_heads=1)
    policy = Policy.from_preset("fp8")
    cache = policy.make_cache(model)
    prompts, ids, mask = left_padded([40])
    greedy(model, ids, mask, 4, cache=cache)
    cache.check_errors()  # finite input: nothing pending
    codec = cache.layers[1].store.pools[next(iter(cache.layers[1].store.pools))].codec
    codec.error_flags().fill_(1)  # as a kernel would after NaN input
    with pytest.raises(ValueError, match="fp8 encode: a call since the last check got NaN/inf input"):
        greedy(model, ids, mask, 2, cache=cache)
