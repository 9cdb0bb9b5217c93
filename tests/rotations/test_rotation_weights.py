"""The value rotation folded into the value and output projections during static decodes (hf.rotation_weights)."""

import pytest
import torch

from conftest import greedy, left_padded, tiny_model
from kvcompose import Policy
from kvcompose.hf import rotation_weights
from kvcompose.hf.static import fast_generate
from kvcompose.rotations import rotate


def _prefilled(model, policy, ids, mask):
    """A cache after the prefill alone, which builds the rotation matrices."""
    cache = policy.make_cache(model)
    fast_generate(model, cache, ids, mask, 1)
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a value bias
@torch.no_grad()
def test_folded_projections_rotate_the_values_and_turn_the_output_back(arch):
    model = tiny_model(arch)
    _, ids, mask = left_padded([9, 12])
    cache = _prefilled(model, Policy.from_preset("fullkv", rotation="hadamard"), ids, mask)
    attention = model.model.layers[1].self_attn
    forward, back, _ = cache.layers[1].rotation_matrices
    x = torch.randn(3, model.config.hidden_size)
    heads = model.config.num_key_value_heads

    head_dim = model.config.hidden_size // model.config.num_attention_heads
    values = attention.v_proj(x).reshape(3, heads, head_dim).transpose(0, 1)[None]
    o_rotated = torch.randn(1, model.config.num_attention_heads, 3, head_dim)
    out = attention.o_proj(rotate(o_rotated, back).transpose(1, 2).reshape(3, -1))  # as the cache turns it back
    with rotation_weights.rotation_in_weights(model, cache) as folded:
        assert folded == model.config.num_hidden_layers and cache.layers[1].rotation_in_weights
        got_values = attention.v_proj(x).reshape(3, heads, head_dim).transpose(0, 1)[None]
        got_out = attention.o_proj(o_rotated.transpose(1, 2).reshape(3, -1))
    torch.testing.assert_close(got_values, rotate(values, forward), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
    assert not cache.layers[1].rotation_in_weights


def test_the_original_weights_come_back_bit_for_bit_and_stay_parameters():
    model = tiny_model("qwen2")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    _, ids, mask = left_padded([9, 12])
    cache = Policy.from_preset("nvfp4", rotation="hadamard").make_cache(model)
    fast_generate(model, cache, ids, mask, 6)
    assert cache.static_decoder.summary()["rotation_in_weights"] == model.config.num_hidden_layers
    for name, p in model.named_parameters():
        assert p is params[name] and not p.is_inference() and torch.equal(p, before[name]), name


def test_without_a_rotation_or_a_foldable_attention_nothing_folds(monkeypatch):
    model = tiny_model("llama")
    _, ids, mask = left_padded([9, 12])
    plain = Policy.from_preset("nvfp4").make_cache(model)
    fast_generate(model, plain, ids, mask, 6)
    assert plain.static_decoder.summary()["rotation_in_weights"] == 0

    policy = Policy.from_preset("nvfp4", rotation="hadamard")
    expected = greedy(model, ids, mask, 12, cache=policy.make_cache(model))
    unfolded = policy.make_cache(model)  # asked not to fold: rotated in the cache
    assert torch.equal(fast_generate(model, unfolded, ids, mask, 12, fold_rotation=False)[:, ids.shape[1]:], expected)
    assert unfolded.static_decoder.summary()["rotation_in_weights"] == 0
    monkeypatch.setattr(rotation_weights, "FOLDABLE_ATTENTION", frozenset())  # an attention it does not know
    cache = policy.make_cache(model)
    assert torch.equal(fast_generate(model, cache, ids, mask, 12)[:, ids.shape[1]:], expected)
    assert cache.static_decoder.summary()["rotation_in_weights"] == 0


def test_fused_layers_stack_the_folded_value_weights_and_give_the_unfused_tokens(monkeypatch):
    from kvcompose.hf import fusion

    monkeypatch.setattr(fusion, "BACKEND", lambda graph, example_inputs: graph.forward)  # traced, run as traced
    model = tiny_model("llama")
    before = [p.detach().clone() for p in model.parameters()]
    policy = Policy.from_preset("nvfp4", rotation="hadamard")
    _, ids, mask = left_padded([20, 13, 31])
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 14, fuse=False)
    cache = policy.make_cache(model)
    assert torch.equal(fast_generate(model, cache, ids, mask, 14, fuse=True), plain)
    summary = cache.static_decoder.summary()
    assert summary["fused"] is True and summary["rotation_in_weights"] == model.config.num_hidden_layers
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _tokens(model, policy, ids, mask, **kw):
    return fast_generate(model, policy.make_cache(model), ids, mask, 10, **kw)


def test_projections_shared_between_layers_rotate_in_the_cache():
    model = tiny_model("llama", layers=3)
    layers = model.model.layers
    layers[1].self_attn.o_proj.weight = layers[0].self_attn.o_proj.weight  # two layers, one weight
    before = [p.detach().clone() for p in model.parameters()]
    policy = Policy.from_preset("fullkv", rotation="hadamard")
    _, ids, mask = left_padded([9, 12])
    cache = policy.make_cache(model)
    got = fast_generate(model, cache, ids, mask, 10)
    assert cache.static_decoder.summary()["rotation_in_weights"] == 1  # only the third layer's are its own
    assert torch.equal(got, _tokens(model, policy, ids, mask, fold_rotation=False))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_each_layer_folds_the_rotation_of_the_cache_layer_its_values_go_to():
    model = tiny_model("llama", layers=3)
    layers = model.model.layers
    layers[0].self_attn.layer_idx, layers[2].self_attn.layer_idx = 2, 0  # renumbered, not reordered
    policy = Policy.from_preset("nvfp4", rotation="hadamard")
    _, ids, mask = left_padded([9, 12])
    assert torch.equal(_tokens(model, policy, ids, mask), _tokens(model, policy, ids, mask, fold_rotation=False))


def test_a_failing_decode_gives_the_original_weights_back(monkeypatch):
    from kvcompose.hf.static import StaticDecoder

    model = tiny_model("qwen2")
    before = [p.detach().clone() for p in model.parameters()]
    step, calls = StaticDecoder.step, []

    def failing(decoder, tokens, plan):
        calls.append(decoder)
        if len(calls) == 3:
            assert decoder.cache.layers[0].rotation_in_weights  # folded while it runs
            raise KeyboardInterrupt
        return step(decoder, tokens, plan)

    monkeypatch.setattr(StaticDecoder, "step", failing)
    cache = Policy.from_preset("fullkv", rotation="hadamard").make_cache(model)
    _, ids, mask = left_padded([9, 12])
    with pytest.raises(KeyboardInterrupt):
        fast_generate(model, cache, ids, mask, 10)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not any(layer.rotation_in_weights for layer in cache.layers)


def test_generate_and_the_timing_take_fold_rotation(monkeypatch):
    """``policy.generate`` and ``speed.time_policy`` pass ``fold_rotation`` to the static-shape path."""
    from conftest import char_tokenizer

    from kvcompose import speed
    from kvcompose.hf import static

    model = tiny_model("llama")
    policy = Policy.from_preset("nvfp4", rotation="hadamard")
    _, ids, mask = left_padded([9, 12])
    for fold, layers in ((True, model.config.num_hidden_layers), (False, 0)):
        row = speed.time_policy(model, policy, ids, mask, 4, fold_rotation=fold)
        assert row["rotation_in_weights"] == layers
    seen, original = [], static.fast_generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fold_rotation"))
        return original(*args, **kwargs)

    monkeypatch.setattr(static, "fast_generate", spy)
    tok = char_tokenizer()
    folded = policy.generate(model, tok, ["abc"], max_new_tokens=6, fast=True)
    kept = policy.generate(model, tok, ["abc"], max_new_tokens=6, fast=True, fold_rotation=False)
    assert seen == [True, False] and len(folded.sequences) == len(kept.sequences) == 1
