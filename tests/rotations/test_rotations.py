"""Rotation of the stored keys and values (kvcompose.rotations): orthogonal, invisible to attention and to every score."""

import pytest
import torch

from conftest import SHORT_RUN_EVICTION, greedy, left_padded
from kvcompose import Policy, registry
from kvcompose.hf.static import fast_generate
from kvcompose.rotations import SignedProduct, rotate, unrotate
from kvcompose.rotations.hadamard import hadamard_matrix


def test_hadamard_matrices_are_orthogonal_and_seeded_per_layer_and_head():
    rot = registry.build("rotation", "hadamard")
    m = rot.matrices(3, 4, 64)
    assert m.shape == (4, 64, 64) and m.dtype == torch.float32
    eye = torch.eye(64).expand(4, 64, 64)
    torch.testing.assert_close(m @ m.transpose(-1, -2), eye, atol=1e-6, rtol=0)
    assert not torch.equal(m[0], m[1])  # heads draw their own signs
    assert not torch.equal(m, rot.matrices(4, 4, 64))  # and so do layers
    assert torch.equal(m, registry.build("rotation", "hadamard").matrices(3, 4, 64))  # fixed by the seed
    assert not torch.equal(m, registry.build("rotation", {"name": "hadamard", "seed": 1}).matrices(3, 4, 64))
    plain = registry.build("rotation", {"name": "hadamard", "random_signs": False}).matrices(0, 2, 8)
    assert torch.equal(plain[0], hadamard_matrix(8)) and torch.equal(plain[1], hadamard_matrix(8))
    assert registry.build("rotation", "none").matrices(0, 4, 64) is None


def test_hadamard_names_a_head_dim_it_cannot_rotate():
    with pytest.raises(ValueError, match="head dim 48 is not a power of two"):
        registry.build("rotation", "hadamard").matrices(0, 2, 48)


def test_rotated_queries_and_keys_keep_every_dot_product_and_values_come_back():
    m = registry.build("rotation", "hadamard").matrices(0, 2, 16)
    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 7, 16), torch.randn(3, 2, 7, 16)
    qr, kr = rotate(q, m), rotate(k, m)
    group = 4  # query heads 0-3 belong to KV head 0, 4-7 to KV head 1
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)
    torch.testing.assert_close(qr @ kr.repeat_interleave(group, dim=1).transpose(-1, -2), logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrotate(rotate(v, m), m), v, atol=1e-6, rtol=0)
    assert not torch.allclose(kr, k)  # the stored keys do change


# Scores from query-key and key-key products (attention mass, cosine redundancy, k-means,
# attention sparsity) do not change under rotation, so with an exact (fp32) store every
# evictor and classifier keeps the same tokens and the model writes the same tokens.
EXACT = {
    "fullkv": {},
    **SHORT_RUN_EVICTION,
    "thinkv": {"budget": 48, "refresh": 16, "precision": {"R": None, "T": None, "E": None}},
}


def kept_positions(cache):
    out = []
    for layer in cache.layers:
        view = layer.store.view()
        out.append([sorted(view.positions[r][view.valid[r]].tolist()) for r in range(view.valid.shape[0])])
    return out


@pytest.mark.parametrize("preset", sorted(EXACT))
def test_rotation_changes_no_decision_and_no_token_with_an_exact_store(llama, preset):
    _, ids, mask = left_padded([20, 13, 31])
    runs = []
    for rotation in (None, "hadamard"):
        cache = Policy.from_preset(preset, rotation=rotation, **EXACT[preset]).make_cache(llama)
        runs.append((greedy(llama, ids, mask, 32, cache=cache), kept_positions(cache), cache.report()))
    (tokens, kept, report), (tokens_r, kept_r, report_r) = runs
    assert torch.equal(tokens, tokens_r)
    assert kept == kept_r
    assert report.evictions == report_r.evictions and report.thought_mix == report_r.thought_mix


def test_attention_output_is_the_same_with_rotation_on_and_off(llama):
    _, ids, mask = left_padded([12, 9])
    logits = []
    for rotation in (None, "hadamard"):
        cache = Policy.from_preset("fullkv", rotation=rotation).make_cache(llama)
        llama.set_attn_implementation("kvcompose")
        out = llama(input_ids=ids, attention_mask=mask, past_key_values=cache)
        step = llama(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                     past_key_values=cache)
        logits.append(torch.cat([out.logits, step.logits], 1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_bf16_rotation_multiplies_exactly_and_keeps_the_attention_scale():
    """In bf16 the ±1 matrix and the 1/D on the way back are exact: the outputs stay within bf16 rounding."""
    from conftest import tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    _, ids, mask = left_padded([12, 9])
    logits = []
    for rotation in (None, "hadamard"):
        cache = Policy.from_preset("fullkv", rotation=rotation).make_cache(model)
        logits.append(model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits.float())
    torch.testing.assert_close(logits[1], logits[0], atol=0.05, rtol=0.05)
    layer = cache.layers[0]
    forward, back, gain = getattr(layer, "runtime", layer).rotation_matrices
    assert isinstance(forward, SignedProduct) and isinstance(back, SignedProduct)  # a sign flip and one product
    forward, back = forward.dense(), back.dense()
    assert forward.dtype == torch.bfloat16 and set(forward.abs().unique().tolist()) == {1.0} and gain == 16.0
    torch.testing.assert_close(forward.float() @ back.float(), torch.eye(16).expand_as(forward), atol=0, rtol=0)


@pytest.mark.parametrize("preset,overrides", [("nvfp4", {}), ("kivi2", {"residual": 8}),
                                              ("rkv", {"budget": 32, "trigger": {"buffer": 8}}),
                                              ("thinkv-int", {"budget": 48, "refresh": 16, "precision": {  # head dim 16
                                                  c: {"name": "int", "bits": 4, "group_size": 16} for c in "RE"}})])
def test_static_decode_gives_the_eager_tokens_with_rotation(llama, preset, overrides):
    policy = Policy.from_preset(preset, rotation="hadamard", **overrides)
    _, ids, mask = left_padded([20, 13, 31])
    expected = greedy(llama, ids, mask, 24, cache=policy.make_cache(llama))
    got = fast_generate(llama, policy.make_cache(llama), ids, mask, 24)[:, ids.shape[1]:]
    assert torch.equal(expected, got)


def test_every_preset_takes_a_rotation_and_its_config_keeps_it():
    from kvcompose.policies.presets import PRESETS

    for name in PRESETS:
        policy = Policy.from_preset(name, rotation={"name": "hadamard", "seed": 3})
        again = Policy.from_config(policy.to_config())
        assert again.rotation == policy.rotation and again.to_config() == policy.to_config()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["nvfp4", "rkv", "thinkv"])
def test_cuda_static_decode_and_graphs_give_the_eager_tokens_with_rotation(preset):
    """Head dim 64 (the compiled paged kernels take every format there), the CUDA graphs on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).cuda().eval().float()
    model.set_attn_implementation("kvcompose")
    overrides = {"rkv": {"budget": 32, "trigger": {"buffer": 8}}, "thinkv": {"budget": 48, "refresh": 16}}
    policy = Policy.from_preset(preset, rotation="hadamard", **overrides.get(preset, {}))
    _, ids, mask = left_padded([20, 13, 31])
    ids, mask = ids.cuda(), mask.cuda()
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 40, graphs=False)
    cache = policy.make_cache(model)
    assert torch.equal(plain, fast_generate(model, cache, ids, mask, 40, graphs=True))
    assert cache.static_decoder.replays > 0


@pytest.mark.parametrize("signs_first", [True, False])
def test_a_signed_product_rotates_as_its_per_head_matrices(signs_first):
    """GQA group 4 over 3 KV heads, prefill-shaped and decode-shaped inputs."""
    g = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (3, 8), generator=g).float() * 2 - 1
    op = SignedProduct(signs, torch.randn(8, 8, generator=g), signs_first)
    for L in (5, 1):
        x = torch.randn(2, 12, L, 8, generator=g)
        torch.testing.assert_close(rotate(x, op), rotate(x, op.dense()), atol=1e-5, rtol=1e-5)
        expected = torch.einsum("bhgld,hde->bhgle", x.view(2, 3, 4, L, 8), op.dense()).reshape(2, 12, L, 8)
        torch.testing.assert_close(rotate(x, op.dense()), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(unrotate(x, op), unrotate(x, op.dense()), atol=1e-5, rtol=1e-5)


def test_rotation_matrices_that_do_not_share_one_up_to_signs_stay_per_head():
    from kvcompose.runtime.layer import _exact_form

    q, _ = torch.linalg.qr(torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0)))
    forward, back, gain = _exact_form(q, torch.float32, "cpu")
    assert not isinstance(forward, SignedProduct) and gain == 1.0
    torch.testing.assert_close(forward @ back, torch.eye(8).expand(2, 8, 8), atol=1e-5, rtol=0)
    h = hadamard_matrix(8)
    permuted = torch.stack([h, h[:, torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])]])  # ±1/sqrt(8), not one up to signs
    forward, back, gain = _exact_form(permuted, torch.float32, "cpu")
    assert not isinstance(forward, SignedProduct) and gain == 8.0
    torch.testing.assert_close(forward @ back, torch.eye(8).expand(2, 8, 8), atol=0, rtol=0)
