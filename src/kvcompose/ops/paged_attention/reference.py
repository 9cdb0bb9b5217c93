"""The plain-torch reference of the paged decode attention.

:func:`paged_decode_attention_torch` dequantizes each source with the formats' reference
functions and runs softmax attention over all their columns with the validity mask. Each
decoded value is rounded to the query dtype, as the dense view is.
"""

from __future__ import annotations

import torch

from ..layout import unpack_codes
from ..quant_fp8 import fp8_dequantize_torch
from ..quant_int import int_token_dequantize_torch
from ..quant_nvfp4 import nvfp4_dequantize_torch
from ..quant_ternary import ternary_dequantize_torch
from .cpu_bound import written_part
from .formats import KVOperand, PagedSource, head_major_rows


def decode_operand_torch(op: KVOperand, slots: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values ``[M, H, D]`` of the given slots (``rows``: the batch row of each), rounded to ``dtype``.
    Gathers use ``index_select`` (on CPU several times faster than indexing with a tensor)."""
    def at(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index)

    if op.fmt == "dense":
        return at(op.codes, slots).to(dtype)
    codes = at(op.codes, slots)
    if op.fmt == "fp8":
        x = fp8_dequantize_torch(codes, at(op.head_scale, rows))
    elif op.fmt == "nvfp4":
        x = nvfp4_dequantize_torch(codes, at(op.scale, slots), at(op.head_scale, rows))
    elif op.fmt == "ternary":
        x = ternary_dequantize_torch(codes, at(op.scale, slots), at(op.head_scale, rows))
    elif op.fmt == "int":
        x = int_token_dequantize_torch(codes, at(op.scale, slots), at(op.minimum, slots), op.bits)
    else:  # int_channel: the scale and minimum of the slot's token group
        group = slots // op.token_group
        q = unpack_codes(codes, op.bits).to(torch.float32)
        x = q * at(op.scale, group).to(torch.float32) + at(op.minimum, group).to(torch.float32)
    return x.to(dtype)


def dense_source_view(src: PagedSource, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[B, H, L, D]`` and validity ``[B, L]`` of one source, decoded to ``dtype``."""
    slots = src.slots()
    B, L = slots.shape
    flat = slots.clamp(min=0)
    rows = torch.arange(B, device=slots.device).repeat_interleave(L)
    k, v = (_operand_view(op, flat, rows, dtype) for op in (src.key, src.value))
    valid = (slots >= 0) & src.valid.index_select(0, flat.reshape(-1)).reshape(B, L)
    return k, v, valid


def _operand_view(op: KVOperand, flat: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous ``[B, H, L, D]`` values of the slots ``flat`` ``[B, L]``. Dense values (the
    buffer, full-precision pools, decoded copies) are gathered straight into that layout, a
    row of ``D`` values per (token, head), with no second pass to put the heads first; decoded
    ones are laid out the same way, so the products see the same tensors either way."""
    B, L = flat.shape
    H, D = op.codes.shape[1], op.head_dim()
    if op.fmt == "dense":
        heads = torch.arange(H, device=flat.device)[:, None]
        if head_major_rows(op.codes):  # a view of [H, slots, D], no copy
            rows_of, index = op.codes.transpose(0, 1).reshape(-1, D), heads * op.codes.shape[0] + flat[:, None, :]
        else:
            rows_of, index = op.codes.reshape(-1, D), flat[:, None, :] * H + heads
        return rows_of.index_select(0, index.reshape(-1)).view(B, H, L, D).to(dtype)
    return decode_operand_torch(op, flat.reshape(-1), rows, dtype).view(B, L, H, D).transpose(1, 2).contiguous()


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
    """Reference: dequantize each source, softmax attention over all their columns with the validity mask.

    Returns ``[B, Hq, 1, D]`` in the query dtype (rows with no valid token get zeros) and,
    with ``return_probs``, the probabilities ``[B, Hq, L]`` over the concatenated columns.
    ``mass``: see :func:`paged_decode_attention`. Each source's keys and values go to the
    products as they are decoded (the logits and outputs of the sources are joined, not their
    keys and values), and each KV head's query heads attend together (GQA).
    """
    B, Hq, _, D = query.shape
    if not return_probs:  # probabilities keep every column: their callers align them with the slots
        sources = [written_part(s) for s in sources]
    parts = [dense_source_view(s, query.dtype) for s in sources]
    H = parts[0][0].shape[1]
    q = query.float().reshape(B, H, Hq // H, D)  # the query heads of each KV head, side by side
    logits = torch.cat([q @ k.float().transpose(-1, -2) for k, _, _ in parts], dim=-1) * scaling
    valid = torch.cat([p[2] for p in parts], dim=1)
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(-1), nan=0.0)  # a row with nothing valid attends to nothing
    widths = [p[2].shape[1] for p in parts]
    out = sum(p @ v.float() for p, (_, v, _) in zip(probs.split(widths, dim=-1), parts))
    out = out.reshape(B, Hq, 1, D).to(query.dtype)
    probs = probs.reshape(B, Hq, -1)
    if mass is not None:
        add_mass_torch(sources, mass, probs)
    return (out, probs) if return_probs else out
