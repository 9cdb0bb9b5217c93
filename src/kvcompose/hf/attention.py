"""The ``kvcompose`` attention function and mask function registered with transformers.

A model loaded with ``attn_implementation="kvcompose"`` calls :func:`kvcompose_attention`
in every attention layer with the new queries, keys and values. The keys carry a
reference to the cache layer that produced them (set by ``KVComposeLayer.update``),
which stores them, attends over what the policy kept, and compresses. Because a
custom attention name gets no mask from transformers unless one is registered,
:func:`kvcompose_mask` is registered too: it hands the 2D padding mask through
unchanged, and the cache reads which new columns are padding from it.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "kvcompose"
LAYER_ATTR = "_kvcompose_layer"


class UnsupportedModelError(ValueError):
    """The model's attention layout cannot run on a kvcompose cache."""


@torch.compiler.disable  # fused decode steps compile the layers around it (kvcompose.hf.fusion)
def kvcompose_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the kvcompose store; signature of transformers' attention interface."""
    layer = getattr(key, LAYER_ATTR, None)
    if layer is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} called the kvcompose attention with keys that did not come from a "
            "kvcompose cache. Pass cache=policy.make_cache(model) (or use policy.generate); if you did, "
            f"this model's attention ({type(module).__module__}) transforms keys after the cache update, a layout "
            "kvcompose does not support."
        )
    if dropout:
        raise ValueError(f"kvcompose attention is for inference; got dropout={dropout} (module in training mode?)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    real = columns = None
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.ndim != 2:
            raise ValueError(
                f"kvcompose expects a 2D padding mask, got a {attention_mask.ndim}D attention mask of shape "
                f"{tuple(attention_mask.shape)}; custom 4D masks are not supported"
            )
        real = attention_mask[:, -query.shape[-2] :].to(torch.bool)
        columns = attention_mask.shape[-1]
    elif layer.layer_idx == 0:  # no mask (transformers drops an all-ones one): the positions tell
        layer.check_positions(kwargs.get("position_ids"))
    layer._pending = False  # the update this attention completes
    return layer.attend(query, key, value, real, scaling, columns), None


def kvcompose_mask(*args, attention_mask=None, **kwargs):
    """Mask function for the ``kvcompose`` name: the 2D padding mask, untouched (or ``None``)."""
    return attention_mask


def register_with_transformers() -> None:
    """Register the attention and mask functions under ``kvcompose`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvcompose_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvcompose_mask)
