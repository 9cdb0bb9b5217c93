"""Fused decode steps (kvcompose.hf.fusion): the decoder layers compiled around the kvcompose
attention give the unfused tokens, and the model gets its own layers back."""

import shutil

import pytest
import torch

from conftest import left_padded, tiny_model
from kvcompose import Policy
from kvcompose.hf import fusion, projections
from kvcompose.hf.attention import UnsupportedModelError
from kvcompose.hf.static import fast_generate

# thinkv: evictions and classifier refreshes inside the steps; the other formats and evictors run
# the same calls between the compiled graphs (their static-path tokens are tested against eager).
PRESETS = {"fullkv": {}, "thinkv": {"budget": 16, "refresh": 8}, "nvfp4": {}, "rkv": {"budget": 32}}


class RecordingBackend:
    """A torch.compile backend that keeps the graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph, example_inputs):
        self.graphs.append(graph)
        return graph.forward


def _model(layers: int = 2):
    model = tiny_model(layers=layers)
    model.set_attn_implementation("kvcompose")
    return model


@pytest.mark.parametrize("preset", ["fullkv", "thinkv"])
def test_fused_layers_give_the_unfused_tokens(monkeypatch, preset):
    backend = RecordingBackend()
    monkeypatch.setattr(fusion, "BACKEND", backend)
    model = _model()
    policy = Policy.from_preset(preset, **PRESETS[preset])
    _, ids, mask = left_padded([20, 13, 31])
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 14, fuse=False)
    assert not backend.graphs
    cache = policy.make_cache(model)
    fused = fast_generate(model, cache, ids, mask, 14, fuse=True)
    assert torch.equal(plain, fused)
    summary = cache.static_decoder.summary()
    assert summary["fused"] is True
    if preset == "thinkv":
        assert summary["eviction_steps"] > 0  # an eviction inside a fused step
    ops = {str(node.target) for graph in backend.graphs for node in graph.graph.nodes}
    assert any("rsqrt" in op for op in ops)  # the norms were compiled...
    assert any("cos" in op for op in ops)  # ...and the rotary embedding, which runs outside the layers...
    assert not any("kvcompose" in op for op in ops)  # ...and the kvcompose attention ran outside the graphs
    # one product for query, key and value, one for gate and up: their stacked weights' rows
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    rows = {node.args[1].meta["example_value"].shape[0] for graph in backend.graphs for node in graph.graph.nodes
            if node.target in projections.LINEAR_OPS}
    assert {(config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim,
            2 * config.intermediate_size} <= rows
    assert config.num_key_value_heads * head_dim not in rows  # no key or value product of its own
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # the model's own layers again
    assert fusion.step_modules(model) == [model.model.rotary_emb, model.model.norm]
    assert all("forward" not in m.__dict__ for m in fusion.step_modules(model))


def test_fused_layers_are_restored_when_a_step_fails(monkeypatch):
    model = _model()
    layers = model.model.layers

    modules = list(layers) + fusion.step_modules(model)
    with pytest.raises(RuntimeError, match="boom"):
        with fusion.fused_layers(model, backend=RecordingBackend()):
            assert all("forward" in m.__dict__ for m in modules)
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in modules)


def test_a_compile_failure_names_the_way_out():
    def failing(graph, example_inputs):
        raise ValueError("no backend today")

    model = _model()
    policy = Policy.from_preset("fullkv")
    _, ids, mask = left_padded([5, 7])
    with pytest.raises(RuntimeError, match="(?s)LlamaDecoderLayer.*no backend today.*fuse=False"):
        with fusion.fused_layers(model, backend=failing):
            fast_generate(model, policy.make_cache(model), ids, mask, 3, fuse=False)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_a_model_without_decoder_layers_is_named():
    class Bare(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="Bare.*fuse=False"):
        fusion.decoder_layers(Bare())


def test_fusion_defaults_to_cuda_only():
    assert fusion.default_fuse(torch.device("cuda")) and not fusion.default_fuse(torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_fused_steps_give_the_unfused_tokens():
    model = _model()
    _, ids, mask = left_padded([20, 13, 31])
    policy = Policy.from_preset("fullkv")
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 12, fuse=False)
    assert torch.equal(plain, fast_generate(model, policy.make_cache(model), ids, mask, 12, fuse=True))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fullkv", "nvfp4", "rkv", "thinkv"])
def test_cuda_fused_graphs_give_the_unfused_tokens(preset):
    """In fp32 the fused step rounds like the eager one; in bf16 it rounds less often (inductor
    keeps a fused chain of products and sums in fp32), so its tokens may part from the
    unfused ones on a random model: fp32 is where they must agree."""
    model = _model().cuda()
    policy = Policy.from_preset(preset, **PRESETS[preset])
    _, ids, mask = left_padded([20, 13, 31])
    ids, mask = ids.cuda(), mask.cuda()
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 48, fuse=False)
    cache = policy.make_cache(model)
    assert torch.equal(plain, fast_generate(model, cache, ids, mask, 48, fuse=True, graphs=True))
    assert cache.static_decoder.replays > 0 and cache.static_decoder.fused
