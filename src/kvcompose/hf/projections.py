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
LINEAR_OPS = (torch._C._nn.linear, F.linear)


class StackedProjection(torch.nn.Module):
    """The product over a group's stacked weights (and biases, where they have them). They are
    buffers, not parameters, and not persistent: the originals' weights, slices of them, stay
    the model's parameters and state-dict entries."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ProjectionSlice(torch.nn.Module):
    """Stands in for one projection of a group: its output columns of the stacked product. It
    holds the original's weight and bias as its own, so the model's parameters and state-dict
    keys do not change while it stands in."""

    def __init__(self, original: torch.nn.Linear, stacked: StackedProjection, start: int, stop: int):
        super().__init__()
        self.weight, self.bias = original.weight, original.bias
        self.stacked = stacked
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked(x)[..., self.start:self.stop]


def stackable_groups(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """(parent module, names) of each group of :data:`SIBLINGS` in ``layer`` whose members are
    :func:`plain_linear` with one input size, dtype and device. Cross-attention is left out:
    there only the query projection runs at decode, and a stacked product would read all three."""
    groups = []
    for parent in layer.modules():
        if getattr(parent, "is_cross_attention", False) or "Cross" in type(parent).__name__:
            continue
        for names in SIBLINGS:
            members = [getattr(parent, name, None) for name in names]
            if all(plain_linear(m) for m in members) and _same_input_and_placement(members):
                groups.append((parent, names))
    return groups


def plain_linear(module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that a stand-in can replace without losing anything:
    no hooks (accelerate's offloading, DeepSpeed's gathering and users' own would be skipped), no
    forward of its own, and weights that are ordinary tensors on a real device, each alone in its
    storage (a view into a flat buffer, as FSDP keeps, would not return to it on exit)."""
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    tensors = [t for t in (module.weight, module.bias) if t is not None]
    return all(type(t.data) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta"
               and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for t in tensors)


def _same_input_and_placement(members: list[torch.nn.Linear]) -> bool:
    """One input size, and every weight and bias of one dtype and device (they are concatenated)."""
    first = members[0].weight
    tensors = [t for m in members for t in (m.weight, m.bias) if t is not None]
    return (all(m.in_features == members[0].in_features for m in members)
            and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
            and len({m.bias is None for m in members}) == 1)


@contextmanager
def stacked_projections(layers: torch.nn.ModuleList):
    """Within the block each group of sibling projections in ``layers`` computes one product
    (see the module's docstring); the modules and their separate weights return on exit. Their
    weights take no gradients meanwhile: the stacked product reads buffers."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []  # (parent, name, original), as made
    try:
        with torch.inference_mode(False):  # weights stay ordinary tensors, usable for training after
            for layer in layers:
                for parent, names in stackable_groups(layer):
                    _stack(parent, names, swapped)
        yield
    finally:
        for parent, name, original in swapped:  # the modules first: nothing below can leave a stand-in
            setattr(parent, name, original)
        with torch.inference_mode(False):
            for _, _, original in swapped:
                for t in (original.weight, original.bias):
                    if t is not None:
                        t.data = t.data.clone()  # storage of its own again; the stacked one is freed


def _stack(parent: torch.nn.Module, names: tuple[str, ...], swapped: list) -> None:
    """Replace ``parent``'s projections ``names`` by stand-ins over one stacked weight; each is
    noted in ``swapped`` as soon as it is replaced. The originals' weights become slices of the
    stacked tensor, which frees their own storage: the weights are not held twice."""
    members = [getattr(parent, name) for name in names]
    weight = torch.cat([m.weight.data for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.data for m in members])
    stacked = StackedProjection(weight, bias)
    start = 0
    for name, member in zip(names, members):
        stop = start + member.out_features
        for t, whole in ((member.weight, weight), (member.bias, bias)):
            if t is not None:
                t.data = whole[start:stop]
        setattr(parent, name, ProjectionSlice(member, stacked, start, stop))
        swapped.append((parent, name, member))
        start = stop


def deduplicate_products(graph: torch.fx.Graph) -> int:
    """Merge the calls of :data:`LINEAR_OPS` in ``graph`` that take the same argument nodes into
    the first of them, as long as nothing between them could change what those nodes hold or
    how a product runs (an in-place operation, a grad or autocast switch, a module call: any
    of them starts afresh); returns how many calls were removed. The stand-ins of a group each
    call the same stacked product, so this leaves one product per group."""
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if _barrier(node):
            seen.clear()
            continue
        if node.op != "call_function" or node.target not in LINEAR_OPS:
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


def _barrier(node: torch.fx.Node) -> bool:
    """Whether ``node`` may mutate a tensor or change how later products run: module calls, methods
    and functions named in place (``add_``) or private (``_enter_autocast``, ``_set_grad_enabled``)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return node.target.endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") or (name.startswith("_") and node.target not in LINEAR_OPS)
    return False
