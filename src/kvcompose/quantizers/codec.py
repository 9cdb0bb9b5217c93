"""Store a quantizer's packed tensors in paged blocks (a :class:`~kvcompose.paging.SlotCodec`).

A quantizer returns a small dataclass of tensors. The codec sorts them once, from
a probe encode, into per-token tensors (kept per slot), per-group tensors (KIVI key
scales, kept per block) and per-head scales. Per-head scales of two-level formats
(fp8's scale, nvfp4's and ternary's s2) are fixed per sequence at its first encode in
that format: ``A[b, h] = headroom · amax`` over the tokens of that encode (after a
prefill: every prompt token that left the buffer). Scales belong to the pool, so
classes that share a format (ThinKV's R and E in NVFP4) share them. The codec hands
the kernels one scale per token and head, ``A[row of the token, h]`` times the
format's unit scale (its scale for amax 1), which is the format's recipe with
``s2 = headroom · amax / max``; the kernels divide and multiply by it themselves, so
encoding reads the model's keys once and decoding writes the model's dtype directly.
Every slot stays self-contained, so blocks can be moved and compacted exactly. A
later token larger than ``headroom`` times the first amax saturates (fp8 at ±448 of
the scaled range; nvfp4/ternary through their block scale).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from ..ops.paged_attention import KVOperand
from ..ops.checks import check_flags, flag_bits, new_flags
from ..paging.codec import SlotCodec
from ..registry import to_config
from .base import Quantizer


class QuantCodec(SlotCodec):
    """Keys and values of one storage format, encoded once when a group leaves the recent buffer."""

    def __init__(self, quantizer: Quantizer, num_kv_heads: int, head_dim: int, device, headroom: float = 2.0):
        if not headroom >= 1.0:
            raise ValueError(f"scale headroom must be >= 1, got {headroom!r}")
        self.quantizer = quantizer
        self.headroom = float(headroom)
        self.name = json.dumps(to_config(quantizer), sort_keys=True)
        self.group_tokens = getattr(quantizer, "token_group", 1) if not quantizer.slot_local else 1
        self.slot_local = quantizer.slot_local
        self.heads, self.head_dim = num_kv_heads, head_dim
        self._flags: torch.Tensor | None = None
        self._probe(device)

    # -------------------------------------------------------------- the probe
    def _probe(self, device) -> None:
        """Encode a tiny input once to learn each packed field's role and shape."""
        n = 2 * self.group_tokens
        x = torch.zeros(n, self.heads, self.head_dim, device=device)
        x[..., 0] = 1.0  # amax 1 on every head: its per-head scale is the format's unit scale
        self.layout: dict[str, dict] = {}
        self._packed_cls: dict[str, type] = {}
        for role in ("key", "value"):
            packed = self.quantizer.quantize(x, role=role)
            self._packed_cls[role] = type(packed)
            fields = {}
            for f in dataclasses.fields(packed):
                value = getattr(packed, f.name)
                if not isinstance(value, torch.Tensor):
                    fields[f.name] = ("const", value)
                elif value.ndim == 1:
                    fields[f.name] = ("head", value)  # the unit per-head scale
                elif value.shape[0] == n:
                    fields[f.name] = ("slot", (tuple(value.shape[1:]), value.dtype))
                else:
                    fields[f.name] = ("group", (tuple(value.shape[1:]), value.dtype))
            self.layout[role] = fields
        self.two_level = any(kind == "head" for f in self.layout.values() for kind, _ in f.values())

    def _tensors(self, kind: str) -> dict:
        return {f"{role[0]}.{name}": spec for role, fields in self.layout.items()
                for name, (k, spec) in fields.items() if k == kind}

    def slot_layout(self, heads, head_dim):
        return self._tensors("slot")

    def block_layout(self, heads, head_dim):
        return self._tensors("group")

    def row_scale_layout(self, heads):
        return {"k": heads, "v": heads} if self.two_level else {}

    def init_row_scales(self, keys, values, sel):
        """``A = headroom · amax`` over each row's selected tokens (``keys`` ``[B, N, H, D]``, ``sel`` ``[B, N]``)."""
        out = {}
        for name, x in (("k", keys), ("v", values)):
            amax = (x.float().abs().amax(-1) * sel[..., None]).amax(1)  # [B, H]
            out[name] = torch.where(amax > 0, amax * self.headroom, torch.ones_like(amax))
        return out

    # ---------------------------------------------------------- encode/decode
    def _error_flags(self, device) -> torch.Tensor:
        """The device flag every encode ORs its errors into (no host synchronization per encode)."""
        if self._flags is None or self._flags.device != torch.device(device):
            self._flags = new_flags(device)
        return self._flags

    def prepare(self, device) -> None:
        self._error_flags(device)

    def error_flags(self) -> torch.Tensor | None:
        return self._flags

    def check_errors(self) -> None:
        if self._flags is not None and flag_bits(self._flags):
            flags, self._flags = self._flags, None
            check_flags(flags, f"{self.quantizer.name} encode")

    def encode(self, keys, values, row_scales):
        slots, groups = {}, {}
        for role, x in (("key", keys), ("value", values)):
            prefix = role[0]
            fields = self.layout[role]
            head_scale = self._token_scales(fields, row_scales, prefix, x.device) if self.two_level else None
            packed = self.quantizer.quantize(x, role=role, head_scale=head_scale, flags=self._error_flags(x.device))
            for name, (kind, _) in fields.items():
                if kind == "slot":
                    slots[f"{prefix}.{name}"] = getattr(packed, name)
                elif kind == "group":
                    groups[f"{prefix}.{name}"] = getattr(packed, name)
        return slots, groups

    @staticmethod
    def _token_scales(fields: dict, row_scales: dict, prefix: str, device) -> torch.Tensor:
        """``[M, H]`` second-level scales of M tokens: their row's ``A`` times the format's unit scale."""
        unit = next(v for k, v in fields.values() if k == "head").to(device)
        return row_scales[prefix].to(device=device, dtype=torch.float32) * unit

    def attention_scales(self, row_scales):
        """The second-level scales ``[B, H]`` of each row's keys and values: its ``A`` times the
        format's unit scale (the products :meth:`kv_operands` hands the attention)."""
        return {prefix: self._token_scales(self.layout[role], row_scales, prefix, row_scales[prefix].device)
                for role, prefix in (("key", "k"), ("value", "v")) if prefix in row_scales}

    def kv_operands(self, slots, groups, scales):
        """The pool's codes and scales for in-place decode attention (no copy, no decode);
        ``scales``: :meth:`attention_scales` of the store's row scales."""
        out = []
        for role in ("key", "value"):
            prefix = role[0]
            fields = self.layout[role]
            t = {name: (slots if kind == "slot" else groups)[f"{prefix}.{name}"]
                 for name, (kind, _) in fields.items() if kind in ("slot", "group")}
            codes = t["codes"]
            head = scales[prefix] if self.two_level else None
            out.append(KVOperand(
                self.quantizer.attention_format(role), codes, scale=t.get("block_scales", t.get("scale")),
                minimum=t.get("minimum"), head_scale=head, bits=getattr(self.quantizer, "bits", 0),
                token_group=getattr(self.quantizer, "token_group", 1),
            ))
        return out[0], out[1]

    def decode(self, slots, blocks, row_scales, dtype: torch.dtype = torch.float32):
        return (self._decode_role("key", slots, blocks, row_scales, dtype),
                self._decode_role("value", slots, blocks, row_scales, dtype))

    def key_tensors(self, names):
        return [n for n in names if n.startswith("k.")]

    def decode_keys(self, slots, blocks, row_scales, dtype: torch.dtype = torch.float32):
        return self._decode_role("key", slots, blocks, row_scales, dtype)

    def _decode_role(self, role: str, slots: dict, blocks: dict, row_scales: dict, dtype: torch.dtype):
        """Keys or values (``role``) of whole blocks: ``[N, S, H, D]``."""
        prefix = role[0]
        first = next(t for name, t in slots.items() if name.startswith(f"{prefix}."))
        nblocks, bs = first.shape[:2]
        kwargs = {}
        for name, (kind, spec) in self.layout[role].items():
            key = f"{prefix}.{name}"
            if kind == "slot":
                kwargs[name] = slots[key].reshape(nblocks * bs, *slots[key].shape[2:])
            elif kind == "group":
                kwargs[name] = blocks[key].reshape(-1, *blocks[key].shape[2:])
            elif kind == "head":
                per_slot = {prefix: row_scales[prefix].repeat_interleave(bs, 0)}  # a row's scale for each slot
                kwargs[name] = self._token_scales(self.layout[role], per_slot, prefix, first.device)
            else:
                kwargs[name] = spec
        x = self.quantizer.dequantize(self._packed_cls[role](**kwargs), dtype)
        return x.reshape(nblocks, bs, *x.shape[1:])
