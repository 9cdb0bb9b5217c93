"""The plain-torch reference of the paged decode attention.

:func:`paged_decode_attention_torch` dequantizes each source with the formats' reference
functions, concatenates, and runs softmax attention with the validity mask. Each decoded
value is rounded to the query dtype, as the dense view is.
"""

from __future__ import annotations

import torch

from ..layout import unpack_codes
from ..quant_fp8 import fp8_dequantize_torch
from ..quant_int import int_token_dequantize_torch
from ..quant_nvfp4 import nvfp4_dequantize_torch
from ..quant_ternary import ternary_dequantize_torch
from .formats import KVOperand, PagedSource


def decode_operand_torch(op: KVOperand, slots: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values ``[M, H, D]`` of the given slots (``rows``: the batch row of each), rounded to ``dtype``."""
    if op.fmt == "dense":
        return op.codes[slots].to(dtype)
    if op.fmt == "fp8":
        x = fp8_dequantize_torch(op.codes[slots], op.head_scale[rows])
    elif op.fmt == "nvfp4":
        x = nvfp4_dequantize_torch(op.codes[slots], op.scale[slots], op.head_scale[rows])
    elif op.fmt == "ternary":
        x = ternary_dequantize_torch(op.codes[slots], op.scale[slots], op.head_scale[rows])
    elif op.fmt == "int":
        x = int_token_dequantize_torch(op.codes[slots], op.scale[slots], op.minimum[slots], op.bits)
    else:  # int_channel: the scale and minimum of the slot's token group
        group = slots // op.token_group
        q = unpack_codes(op.codes[slots], op.bits).to(torch.float32)
        x = q * op.scale[group].to(torch.float32) + op.minimum[group].to(torch.float32)
    return x.to(dtype)


def dense_source_view(src: PagedSource, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[B, H, L, D]`` and validity ``[B, L]`` of one source, decoded to ``dtype``."""
    slots = src.slots()
    B, L = slots.shape
    ok = slots >= 0
    flat = slots.clamp(min=0).reshape(-1)
    rows = torch.arange(B, device=slots.device).repeat_interleave(L)
    k = decode_operand_torch(src.key, flat, rows, dtype)
    v = decode_operand_torch(src.value, flat, rows, dtype)
    valid = ok & src.valid[flat].reshape(B, L)
    shape = (B, L, *k.shape[1:])
    return k.reshape(shape).transpose(1, 2), v.reshape(shape).transpose(1, 2), valid


def add_mass_torch(sources: list[PagedSource], mass: tuple[list[torch.Tensor], torch.Tensor],
                   probs: torch.Tensor) -> None:
    """Reference of the ``mass`` output: add ``weight[b]`` times the probabilities ``[B, Hq, L]``
    averaged over the query heads to each source's flat per-slot channel (fixed shapes: a
    missing block adds zero to slot 0)."""
    channels, weight = mass
    delta = probs.float().mean(dim=1) * weight.float()[:, None]
    col = 0
    for src, channel in zip(sources, channels):
        slots = src.slots()
        d = delta[:, col:col + slots.shape[1]]
        channel.index_add_(0, slots.clamp(min=0).reshape(-1), torch.where(slots >= 0, d, 0.0).reshape(-1))
        col += slots.shape[1]


def paged_decode_attention_torch(query: torch.Tensor, sources: list[PagedSource], scaling: float,
                                 return_probs: bool = False, mass=None):
    """Reference: dequantize each source, concatenate, softmax attention with the validity mask.

    Returns ``[B, Hq, 1, D]`` in the query dtype (rows with no valid token get zeros) and,
    with ``return_probs``, the probabilities ``[B, Hq, L]`` over the concatenated columns.
    ``mass``: see :func:`paged_decode_attention`.
    """
    B, Hq, _, D = query.shape
    parts = [dense_source_view(s, query.dtype) for s in sources]
    keys = torch.cat([p[0] for p in parts], dim=2).float()
    values = torch.cat([p[1] for p in parts], dim=2).float()
    valid = torch.cat([p[2] for p in parts], dim=1)
    H, L = keys.shape[1], keys.shape[2]
    q = query.float().reshape(B, H, Hq // H, D)  # the query heads of each KV head, side by side (GQA)
    logits = (q @ keys.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(-1), nan=0.0)  # a row with nothing valid attends to nothing
    out = (probs @ values).reshape(B, Hq, 1, D).to(query.dtype)
    probs = probs.reshape(B, Hq, L)
    if mass is not None:
        add_mass_torch(sources, mass, probs)
    return (out, probs) if return_probs else out
