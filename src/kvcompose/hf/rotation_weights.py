"""The value rotation carried by the model's value and output projections while a static decode runs.

A policy with a rotation (``rotation="hadamard"``) stores each KV head's values as ``v R`` and
turns every attention output back, ``o R^T`` (:mod:`kvcompose.rotations`). Both are linear
maps beside a linear projection, so they fold into its weights, per head: ``v R`` is the
value projection with rows ``R^T W_v``, and ``(o R^T) W_o^T`` is the output projection with
columns ``W_o R``. With them folded, a decode step rotates only its queries and keys (after
RoPE, where no weight can take the rotation): one launch per layer instead of two, and no
work on the values or the output at all.

:func:`rotation_in_weights` swaps the folded weights in for the decode steps and the originals
back on exit, untouched: the folded weights are new tensors, so the model holds one more value
and output projection per layer while it decodes. It folds only attention classes whose value
projection feeds the cache and whose output projection reads the attention output with nothing
in between (:data:`FOLDABLE_ATTENTION`); other layers, projections that are not plain
``nn.Linear`` (hooks, tensor-parallel shards) and projections shared between layers keep the
rotation in the cache.

The folded weights are rounded to the model's dtype once, where the cache rounds the rotated
values and outputs at every step: the same size of error, but in bf16 not the same bits, so
a folded static decode may part from the eager tokens after some steps, as a fused one may
(``fast_generate(..., fold_rotation=False)`` keeps the cache's rounding).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..rotations import SignedProduct
from .attention import UnsupportedModelError
from .fusion import decoder_layers
from .projections import plain_linear

#: Attention modules whose ``v_proj`` output goes to the cache unchanged and whose ``o_proj`` reads
#: the attention output unchanged (no value norm, no clipping, no output gate): the rotation folds.
FOLDABLE_ATTENTION = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                                "Qwen3MoeAttention"})


@contextmanager
def rotation_in_weights(model, cache):
    """Within the block, the value and output projections of ``model``'s foldable layers carry
    ``cache``'s value rotation, and those layers' runtimes rotate only queries and keys; yields
    the number of layers folded. The rotation matrices are the ones the prefill built."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (parameter, its original data)
    runtimes = []
    try:
        with torch.no_grad(), torch.inference_mode(False):  # the originals stay ordinary tensors
            for attention, runtime in _unshared(_foldable_layers(model, cache)):
                forward, back, _ = runtime.rotation_matrices
                if _fold(attention, _dense(forward), _dense(back), swapped):
                    runtime.rotation_in_weights = True
                    runtimes.append(runtime)
        yield len(runtimes)
    finally:
        for runtime in runtimes:
            runtime.rotation_in_weights = False
        for parameter, original in reversed(swapped):
            parameter.data = original


def _layers(model) -> list[torch.nn.Module]:
    """The decoder layers, or none where the model does not list them (nothing folds)."""
    try:
        return list(decoder_layers(model))
    except UnsupportedModelError:
        return []


def _foldable_layers(model, cache) -> list[tuple[torch.nn.Module, object]]:
    """(attention module, its cache layer) of every foldable layer whose cache layer rotates; the
    cache layer is the one the module's values go to (its ``layer_idx``)."""
    found = []
    for index, layer in enumerate(_layers(model)):
        attention = _foldable_attention(layer)
        if attention is not None:
            runtime = cache.layers[getattr(attention, "layer_idx", index)]
            if runtime.rotation_matrices:
                found.append((attention, runtime))
    return found


def _unshared(layers: list) -> list:
    """The layers none of whose value or output weights another layer holds too: a shared weight
    would carry two layers' rotations, so those layers rotate in the cache."""
    def weights(attention):
        return [id(t) for m in (attention.v_proj, attention.o_proj) for t in (m.weight, m.bias) if t is not None]

    seen: dict[int, int] = {}
    for attention, _ in layers:
        for key in weights(attention):
            seen[key] = seen.get(key, 0) + 1
    return [(a, r) for a, r in layers if all(seen[key] == 1 for key in weights(a))]


def _foldable_attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The attention module of ``layer`` if its class is transformers' own of a name in
    :data:`FOLDABLE_ATTENTION` (not remote code of the same name) and its value and output
    projections are :func:`~kvcompose.hf.projections.plain_linear`."""
    for module in layer.modules():
        if type(module).__name__ in FOLDABLE_ATTENTION and type(module).__module__.startswith("transformers."):
            v, o = getattr(module, "v_proj", None), getattr(module, "o_proj", None)
            return module if plain_linear(v) and plain_linear(o) else None
    return None


def _dense(matrices) -> torch.Tensor:
    """``[H, D, D]`` fp32 matrices (row vectors multiplied on the right) of a rotation's form."""
    return (matrices.dense() if isinstance(matrices, SignedProduct) else matrices).float()


def _fold(attention: torch.nn.Module, forward: torch.Tensor, back: torch.Tensor, swapped: list) -> bool:
    """Swap in ``attention``'s folded value and output weights (noting the originals in
    ``swapped``); False, with nothing swapped, where the projections' shapes do not split into
    the rotation's heads."""
    v, o = attention.v_proj, attention.o_proj
    H, D = forward.shape[0], forward.shape[-1]
    if v.out_features != H * D or o.in_features % (H * D):
        return False
    group = o.in_features // (H * D)  # query heads per KV head, laid out KV head by KV head
    by_head = v.weight.float().reshape(H, D, v.in_features)
    folded = {v.weight: (forward.transpose(1, 2) @ by_head).reshape_as(v.weight)}  # rows R_h^T W_v,h
    if v.bias is not None:
        folded[v.bias] = (v.bias.float().reshape(H, 1, D) @ forward).reshape_as(v.bias)
    columns = o.weight.float().reshape(o.out_features, H, group, D)
    folded[o.weight] = torch.einsum("ohgd,hed->ohge", columns, back).reshape_as(o.weight)  # W_o,j B_h^T
    for parameter, weight in folded.items():
        swapped.append((parameter, parameter.data))
        parameter.data = weight.to(parameter.dtype)
    return True
