"""Sibling projections stacked into one matrix product while fused decode steps run.

At decode batch sizes each projection of a decoder layer is a matrix-vector product: it reads
its weight once, and a small one (a 4096 x 1024 key or value projection at Llama-3-8B shapes)
reaches about a third of copy bandwidth, plus a split-K reduction kernel. The query, key and
value projections read the same input, as do the MLP's gate and up projections, so one product
over their stacked weights reads the same bytes in one kernel.

While fused layers run, :func:`stacked_projections` copies each such group's weights into one
tensor, points the original weights at slices of it (so memory does not grow) and puts
stand-ins in the modules' places: each returns its columns of the product over the stacked
weight. The traced graph then holds the same ``linear`` call once per stand-in, and
:func:`deduplicate_products` (run by the fused layers' compile backend) keeps one. On exit the
originals return, each with storage of its own again.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

#: Groups of sibling projections, by attribute name, that read the same input in the decoder
#: layers transformers ships (Llama, Mistral, Qwen, Gemma, ...). A layer whose modules are named
#: otherwise keeps its projections apart.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: The calls that :func:`deduplicate_products` merges when their arguments are the same nodes.
PRODUCTS = (torch._C._nn.linear, F.linear)


class StackedProjection(torch.nn.Module):
    """The product over a group's stacked weights (and biases, where they have them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ProjectionSlice(torch.nn.Module):
    """Stands in for one projection of a group: its output columns of the stacked product."""

    def __init__(self, stacked: StackedProjection, start: int, stop: int):
        super().__init__()
        self.stacked = stacked
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked(x)[..., self.start:self.stop]


def stackable_groups(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """(parent module, names) of each group of :data:`SIBLINGS` in ``layer`` whose members are
    plain ``nn.Linear`` modules with ordinary weights of one input size, dtype and device
    (a quantized or sharded projection is left as it is)."""
    groups = []
    for parent in layer.modules():
        for names in SIBLINGS:
            members = [getattr(parent, name, None) for name in names]
            if all(_plain_linear(m) for m in members) and _alike(members):
                groups.append((parent, names))
    return groups


def _plain_linear(module) -> bool:
    return (type(module) is torch.nn.Linear and type(module.weight.data) is torch.Tensor
            and module.weight.layout == torch.strided)


def _alike(members: list[torch.nn.Linear]) -> bool:
    first = members[0]
    same = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device for m in members)
    return same and len({m.bias is None for m in members}) == 1


@contextmanager
def stacked_projections(layers: torch.nn.ModuleList):
    """Within the block each group of sibling projections in ``layers`` computes one product
    (see the module's docstring); the modules and their separate weights return on exit."""
    swapped = []  # (parent, name, original module)
    try:
        with torch.inference_mode(False):  # weights stay ordinary tensors, usable for training after
            for layer in layers:
                for parent, names in stackable_groups(layer):
                    swapped += _stack(parent, names)
        yield
    finally:
        with torch.inference_mode(False):
            for parent, name, original in reversed(swapped):
                setattr(parent, name, original)
                original.weight.data = original.weight.data.clone()
                if original.bias is not None:
                    original.bias.data = original.bias.data.clone()


def _stack(parent: torch.nn.Module, names: tuple[str, ...]) -> list:
    members = [getattr(parent, name) for name in names]
    weight = torch.cat([m.weight.data for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.data for m in members])
    stacked = StackedProjection(weight, bias)
    swapped, start = [], 0
    for name, member in zip(names, members):
        stop = start + member.out_features
        member.weight.data = weight[start:stop]  # the original storage is freed; no copy kept twice
        if bias is not None:
            member.bias.data = bias[start:stop]
        setattr(parent, name, ProjectionSlice(stacked, start, stop))
        swapped.append((parent, name, member))
        start = stop
    return swapped


def deduplicate_products(graph: torch.fx.Graph) -> int:
    """Merge the calls of :data:`PRODUCTS` in ``graph`` whose arguments are the same nodes into
    the first of them; returns how many were removed. (Products are pure, so this only drops
    repeated work: the stand-ins of a group each call the same stacked product.)"""
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in PRODUCTS:
            continue
        key = (node.target, tuple(node.args), tuple(sorted(node.kwargs.items())))
        try:
            hash(key)
        except TypeError:  # an argument that is not a node or a constant: leave the call as it is
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return removed
