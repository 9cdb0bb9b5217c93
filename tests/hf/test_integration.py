"""The transformers integration on tiny random models: exactness, batching, eviction, errors."""

import pytest
import torch

from conftest import char_tokenizer, greedy, left_padded, tiny_model
from kvcompose import Policy
from kvcompose.hf import CacheReuseError, UnsupportedModelError

ARCHS = [("llama", 2), ("llama", 4), ("qwen2", 2)]  # GQA and MHA, two architectures


@pytest.mark.parametrize("arch,kv_heads", ARCHS)
def test_fullkv_matches_transformers_greedy(arch, kv_heads):
    model = tiny_model(arch, kv_heads=kv_heads)
    _, ids, mask = left_padded([5, 13, 9])
    reference = greedy(model, ids, mask, 30, impl="sdpa")
    ours = greedy(model, ids, mask, 30, cache=Policy.from_preset("fullkv").make_cache(model))
    assert torch.equal(ours, reference)


SMALL = {
    "fullkv": {},
    "streamingllm": {"budget": 20},
    "rkv": {"budget": 16, "trigger": {"buffer": 8}},
    "snapkv": {"budget": 16, "trigger": {"buffer": 8}},
    "h2o": {"budget": 16},
    "rpc": {"protect_recent": 4, "trigger": {"period": 16, "ratio": 4, "recent": 4}, "evictor": {"window": 4}},
}


@pytest.mark.parametrize("preset,overrides", sorted(SMALL.items()))
def test_batch_rows_equal_single_runs(llama, preset, overrides):
    policy = Policy.from_preset(preset, **overrides)
    prompts, ids, mask = left_padded([4, 17, 10])
    batch = greedy(llama, ids, mask, 40, cache=policy.make_cache(llama))
    for i, p in enumerate(prompts):
        alone = greedy(llama, p[None], torch.ones(1, len(p), dtype=torch.long), 40, cache=policy.make_cache(llama))
        assert torch.equal(batch[i], alone[0]), f"row {i} differs from its single-sequence run"


def _step_by_step(model, policy, ids, mask, steps):
    """Prefill + greedy decode by hand, returning the cache and a report after every step."""
    cache = policy.make_cache(model)
    reports = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache)
            reports.append(cache.report())
    return cache, reports


def test_streamingllm_keeps_sinks_and_window_and_memory_is_flat(llama):
    budget, sinks = 24, 4
    policy = Policy.from_preset("streamingllm", budget=budget, sinks=sinks)
    _, ids, mask = left_padded([6, 19, 11])
    cache, reports = _step_by_step(llama, policy, ids, mask, steps=60)
    width = ids.shape[1]
    for layer in cache.layers:
        view = layer.store.view()
        seen = layer.store.tokens_seen
        for b in range(ids.shape[0]):
            kept = sorted(view.positions[b][view.valid[b]].tolist())
            pad = width - int(mask[b].sum())
            real_positions = list(range(pad, layer.store.columns_seen))
            assert kept == real_positions[:sinks] + real_positions[-(budget - sinks):]
            assert int(seen[b]) == len(real_positions)
    # Once every row is past the budget, the bytes held stay flat (up to one partly filled
    # block per row and layer, as tokens move from the buffer into blocks) while the full cache grows.
    steady = reports[20:]
    block = cache.layers[0].store.regions[0].pool.bytes_per_block
    held = [r.kv_bytes for r in steady]
    assert max(held) - min(held) <= block * ids.shape[0] * len(cache.layers)
    assert max(held[-20:]) <= max(held[:20])
    assert all(a.full_kv_bytes < b.full_kv_bytes for a, b in zip(steady, steady[1:]))
    assert steady[-1].kv_bytes < steady[-1].full_kv_bytes
    assert all(r.tokens_kept == [[budget] * 3] * len(cache.layers) for r in steady)


def test_freed_blocks_are_reused(llama):
    policy = Policy.from_preset("streamingllm", budget=24)
    _, ids, mask = left_padded([30, 12])
    cache, _ = _step_by_step(llama, policy, ids, mask, steps=5)
    mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)  # the columns the cache has seen
    evictions = sum(layer.store.evictions for layer in cache.layers)
    capacity = []  # per step, per layer
    with torch.no_grad():
        for _ in range(80):
            nxt = torch.full((2, 1), 7)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            llama(input_ids=nxt, attention_mask=mask, past_key_values=cache)
            pools = [layer.store.regions[0].pool for layer in cache.layers]
            assert all(p.num_free <= 2 for p in pools), "more than one free block per row"
            capacity.append([p.capacity for p in pools])
    assert sum(layer.store.evictions for layer in cache.layers) > evictions + 100
    first, last = capacity[:40], capacity[40:]  # the blocks evictions free are the ones later steps take
    assert all(max(a) <= max(b) for a, b in zip(zip(*last), zip(*first)))


def test_cache_reports_tokens_seen_not_kept(llama):
    policy = Policy.from_preset("streamingllm", budget=16)
    _, ids, mask = left_padded([20])
    cache, _ = _step_by_step(llama, policy, ids, mask, steps=10)
    assert cache.get_seq_length() == 30
    assert cache.report().tokens_kept == [[16], [16]]


def test_sampling_runs_and_is_seeded(llama):
    policy = Policy.from_preset("streamingllm", budget=20)
    _, ids, mask = left_padded([5, 9])
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(greedy(llama, ids, mask, 25, cache=policy.make_cache(llama), do_sample=True, temperature=1.0))
    assert torch.equal(outs[0], outs[1])


def test_sampling_fullkv_matches_transformers(llama):
    _, ids, mask = left_padded([5, 9])
    torch.manual_seed(7)
    ref = greedy(llama, ids, mask, 20, impl="sdpa", do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(7)
    ours = greedy(llama, ids, mask, 20, cache=Policy.from_preset("fullkv").make_cache(llama),
                  do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(ours, ref)


def test_wrong_attention_implementation_is_rejected(llama):
    llama.set_attn_implementation("sdpa")
    try:
        with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*attn_implementation='kvcompose'"):
            Policy.from_preset("fullkv").make_cache(llama)
    finally:
        llama.set_attn_implementation("kvcompose")


def test_sliding_window_layout_is_rejected():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, layer_types=["sliding_attention"] * 2,
                           sliding_window=8)
    model = MistralForCausalLM(config)
    model.set_attn_implementation("kvcompose")
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM.*sliding_attention"):
        Policy.from_preset("fullkv").make_cache(model)


def test_attention_without_kvcompose_cache_names_the_module(llama):
    _, ids, mask = left_padded([4])
    with pytest.raises(UnsupportedModelError, match="LlamaAttention"):
        llama(input_ids=ids, attention_mask=mask, use_cache=False)


def test_cache_refuses_beam_search(llama):
    _, ids, mask = left_padded([4])
    with pytest.raises(ValueError, match="beam"):
        greedy(llama, ids, mask, 5, cache=Policy.from_preset("fullkv").make_cache(llama), num_beams=2)


def test_generate_helper_restores_attention_and_reports(llama):
    tok = char_tokenizer()
    llama.set_attn_implementation("sdpa")
    try:
        out = Policy.from_preset("streamingllm", budget=16).generate(llama, tok, ["abc", "hello world"], max_new_tokens=12)
        assert llama.config._attn_implementation == "sdpa"
    finally:
        llama.set_attn_implementation("kvcompose")
    assert len(out.texts) == 2 and len(out.sequences) == 2
    assert all(len(s) == 12 for s in out.sequences)
    r = out.report
    # The last generated token is never fed back through the model, so it is not in the cache.
    assert r.tokens_seen == [3 + 11, 11 + 11]
    assert r.kv_bytes <= r.peak_kv_bytes <= r.allocated_bytes + r.peak_kv_bytes
    assert r.full_kv_bytes > 0 and r.evictions > 0


@pytest.mark.parametrize("preset", ["fullkv", "snapkv", "thinkv"])
def test_a_cache_serves_one_generation(llama, preset):
    """A second generate on a used cache raises (it used to continue the first run's
    sequence silently); after reset() the cache gives a fresh cache's tokens."""
    policy = Policy.from_preset(preset, **({"budget": 32} if Policy.from_preset(preset).evictor else {}))
    _, ids, mask = left_padded([20, 9])
    cache = policy.make_cache(llama)
    first = greedy(llama, ids, mask, 12, cache=cache)
    with pytest.raises(CacheReuseError, match=r"holds 31 columns, but the attention mask covers 20 .*make a new one with policy.make_cache"):
        greedy(llama, ids, mask, 12, cache=cache)
    cache.reset()
    assert cache.report().kv_bytes == 0 and cache.report().steps == 0 and cache.peak_kv_bytes == 0
    assert torch.equal(greedy(llama, ids, mask, 12, cache=cache), first)


def test_a_forward_that_skips_columns_is_refused(llama):
    cache = Policy.from_preset("fullkv").make_cache(llama)
    ids = torch.randint(1, 96, (1, 6))
    llama(input_ids=ids, attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)
    with pytest.raises(CacheReuseError, match="covers 9 columns for 1 new ones \\(expected 7\\)"):
        llama(input_ids=ids[:, :1], attention_mask=torch.ones(1, 9, dtype=torch.long), past_key_values=cache)


@pytest.mark.parametrize("preset", ["fullkv", "streamingllm", "snapkv", "h2o", "fp8", "nvfp4", "kivi2", "thinkv"])
def test_non_finite_keys_raise_the_same_error_for_every_preset(preset):
    """NaN keys used to pass silently under the full-precision presets (the output was token
    0 repeated); every preset now raises once, naming the layer."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, :] = float("nan")
    _, ids, mask = left_padded([12, 7])
    budget = {"budget": 32} if Policy.from_preset(preset).evictor else {}  # a preset that never evicts takes none
    cache = Policy.from_preset(preset, **budget).make_cache(model)
    with pytest.raises(ValueError, match="^layer 1: the model produced NaN/inf keys or values"):
        greedy(model, ids, mask, 3, cache=cache)
    cache.check_errors()  # raised once: nothing left pending


def test_the_cache_goes_by_the_name_the_model_takes():
    """transformers renamed past_key_values to cache; kvcompose passes whichever forward takes."""
    from types import SimpleNamespace

    from kvcompose.hf.compat import cache_kwargs, returned_cache

    class Renamed:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Before:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_kwargs(Renamed(), "c") == {"cache": "c"}
    assert cache_kwargs(Before(), "c") == {"past_key_values": "c"}
    assert returned_cache(SimpleNamespace(cache="new", past_key_values="old")) == "new"
    assert returned_cache(SimpleNamespace(past_key_values="old")) == "old"


def test_accumulating_attention_in_query_chunks_equals_one_pass(llama, monkeypatch):
    """h2o's probabilities over a prefill's queries come in chunks (a long prompt's would not
    fit whole): the output and the attention mass equal one pass's, and so do the tokens."""
    from types import SimpleNamespace

    from kvcompose.evictors.h2o import H2OEvictor
    from kvcompose.runtime import attention as hf_cache

    g = torch.Generator().manual_seed(0)
    B, Hq, H, T, L, D = 2, 4, 2, 9, 12, 8
    query = torch.randn(B, Hq, T, D, generator=g)
    view = SimpleNamespace(keys=torch.randn(B, H, L, D, generator=g), values=torch.randn(B, H, L, D, generator=g),
                           valid=torch.rand(B, L, generator=g) > 0.2)
    mask = view.valid[:, None, None, :] & (torch.rand(B, 1, T, L, generator=g) > 0.3)
    mask = mask | ~mask.any(-1, keepdim=True)
    positions = torch.arange(T).repeat(B, 1)
    positions[0, :2] = -1  # padding queries receive nothing
    observe = H2OEvictor().observe
    whole_out, whole = hf_cache._attention_observed(query, view, mask, positions, 0.3, observe)
    monkeypatch.setattr(hf_cache, "PROBS_CHUNK_BYTES", 2 * B * Hq * L * 4)  # two queries per chunk
    out, parts = hf_cache._attention_observed(query, view, mask, positions, 0.3, observe)
    assert torch.allclose(out, whole_out, atol=1e-6) and torch.allclose(parts["acc"], whole["acc"], atol=1e-6)

    policy = Policy.from_preset("h2o", budget=16)
    _, ids, mask = left_padded([4, 17, 30])
    monkeypatch.setattr(hf_cache, "PROBS_CHUNK_BYTES", 1)  # one query per chunk
    chunked = greedy(llama, ids, mask, 24, cache=policy.make_cache(llama))
    monkeypatch.undo()
    assert torch.equal(chunked, greedy(llama, ids, mask, 24, cache=policy.make_cache(llama)))
