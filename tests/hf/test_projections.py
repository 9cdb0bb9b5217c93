"""Stacked sibling projections (kvcompose.hf.projections): one product per group while fused
layers run, the same outputs, no extra weight memory, and the model's own modules after."""

import pytest
import torch

from conftest import tiny_model
from kvcompose.hf import projections


def _storages(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_stand_ins_give_each_projection_its_own_output_from_one_stacked_weight():
    model = tiny_model(layers=2)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = zip((attn, mlp), projections.SIBLINGS)
    parents = {name: parent for parent, names in groups for name in names}
    x = torch.randn(3, 1, model.config.hidden_size)
    expected = {name: getattr(parent, name)(x) for name, parent in parents.items()}
    originals = {name: getattr(parent, name) for name, parent in parents.items()}
    with torch.inference_mode(), projections.stacked_projections(model.model.layers):
        assert isinstance(attn.q_proj, projections.ProjectionSlice)
        for name, parent in parents.items():
            torch.testing.assert_close(getattr(parent, name)(x), expected[name], rtol=1e-6, atol=1e-6)
        # the originals' weights are slices of the stacked one: one storage per group, none copied
        stacked = attn.q_proj.stacked.weight
        assert {originals[n].weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")} == {
            stacked.untyped_storage().data_ptr()}
    assert all(getattr(parent, name) is originals[name] for name, parent in parents.items())
    assert len(_storages(attn)) == 4  # q, k, v and o each own their storage again
    for name, parent in parents.items():
        assert not originals[name].weight.is_inference()  # stacked and restored outside inference mode
        torch.testing.assert_close(getattr(parent, name)(x), expected[name], rtol=0, atol=0)


def test_modules_are_restored_when_the_block_fails():
    model = tiny_model(layers=1)
    q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(RuntimeError, match="boom"):
        with projections.stacked_projections(model.model.layers):
            raise RuntimeError("boom")
    assert model.model.layers[0].self_attn.q_proj is q_proj


def test_a_group_with_a_module_that_is_not_a_plain_linear_is_left_apart():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = tiny_model(layers=1)
    attn = model.model.layers[0].self_attn
    scaled = Scaled(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    attn.k_proj = scaled
    groups = [names for _, names in projections.stackable_groups(model.model.layers[0])]
    assert groups == [("gate_proj", "up_proj")]
    with projections.stacked_projections(model.model.layers):
        assert attn.k_proj is scaled and isinstance(attn.q_proj, torch.nn.Linear)


def test_repeated_products_are_merged_and_others_kept():
    def step(x, w, other):  # weights as inputs, as the traced layers receive them
        a = torch.nn.functional.linear(x, w)[..., :2]
        b = torch.nn.functional.linear(x, w)[..., 2:]
        c = torch.nn.functional.linear(x, other)
        return a.sum() + b.sum() + c.sum()

    graph_module = torch.fx.symbolic_trace(step)
    inputs = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4)
    expected = step(*inputs)
    assert projections.deduplicate_products(graph_module.graph) == 1
    graph_module.recompile()
    linears = [n for n in graph_module.graph.nodes if n.target in projections.LINEAR_OPS]
    assert len(linears) == 2
    torch.testing.assert_close(graph_module(*inputs), expected)


def test_products_on_either_side_of_an_in_place_change_stay_apart():
    def step(x, w):
        a = torch.nn.functional.linear(x, w)
        x.add_(1.0)  # the second product sees another x
        return a, torch.nn.functional.linear(x, w)

    graph_module = torch.fx.symbolic_trace(step)
    assert projections.deduplicate_products(graph_module.graph) == 0
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    graph_module.recompile()
    a, b = graph_module(x.clone(), w)
    torch.testing.assert_close(b - a, (torch.ones(3, 4) @ w.T).expand_as(a), atol=1e-5, rtol=1e-5)


def test_modules_with_hooks_or_without_real_storage_keep_their_projections():
    model = tiny_model(layers=1)
    attn = model.model.layers[0].self_attn
    assert projections.plain_linear(attn.q_proj)
    handle = attn.k_proj.register_forward_hook(lambda *args: None)
    assert not projections.plain_linear(attn.k_proj)
    assert [names for _, names in projections.stackable_groups(model.model.layers[0])] == [("gate_proj", "up_proj")]
    handle.remove()
    assert not projections.plain_linear(torch.nn.Linear(4, 4, device="meta"))
    flat = torch.zeros(40)
    view = torch.nn.Linear(4, 4, bias=False)
    view.weight.data = flat[8:24].view(4, 4)  # a slice of a flat buffer: it would not return there
    assert not projections.plain_linear(view)


def test_state_dict_and_parameters_keep_their_names_while_stacked():
    model = tiny_model(layers=2)
    keys = list(model.state_dict())
    names = [name for name, _ in model.named_parameters()]
    with projections.stacked_projections(model.model.layers):
        assert list(model.state_dict()) == keys
        assert [name for name, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys


def test_cross_attention_keeps_its_projections():
    class CrossAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    layer = torch.nn.Module()
    layer.encoder_attn = CrossAttention()
    assert projections.stackable_groups(layer) == []
