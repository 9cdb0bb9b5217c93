"""Slot codecs: how one storage format lays a token's K and V out in a block.

A codec turns ``[M, H, D]`` keys and values into named tensors (the *payload*):
per-slot tensors with a leading token dimension and, for formats whose scales span
a group of tokens (KIVI keys), per-block tensors. Pools allocate exactly these
tensors, so the memory report counts the compressed bytes actually held.
"""

from __future__ import annotations

import torch

from ..ops.paged_attention import KVOperand


class SlotCodec:
    """Base class. ``group_tokens > 1`` means tokens are encoded ``group_tokens`` at a time."""

    name = "codec"
    group_tokens = 1
    slot_local = True  # every token's payload is independent of other tokens

    def slot_layout(self, heads: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot tensors: ``{name: (shape after the token dim, dtype)}``."""
        raise NotImplementedError  # pragma: no cover - interface

    def block_layout(self, heads: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-block tensors (only formats with ``group_tokens > 1``)."""
        return {}

    def encode(self, keys: torch.Tensor, values: torch.Tensor, row_scales: dict) -> tuple[dict, dict]:
        """``[M, H, D]`` → (per-slot tensors ``[M, ...]``, per-block tensors ``[M // group_tokens, ...]``)."""
        raise NotImplementedError  # pragma: no cover - interface

    def decode(self, slots: dict, blocks: dict, row_scales: dict,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot tensors ``[N, S, ...]`` of ``N`` whole blocks → keys, values ``[N, S, H, D]``
        (``dtype``: what quantized formats decode to; stored dense tensors come back as they are)."""
        raise NotImplementedError  # pragma: no cover - interface

    def key_tensors(self, names: list[str]) -> list[str]:
        """Which of a pool's per-slot and per-block tensors :meth:`decode_keys` reads; default: all."""
        return names

    def decode_keys(self, slots: dict, blocks: dict, row_scales: dict,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The keys of :meth:`decode` alone (what evictors and classifiers score); ``slots`` and
        ``blocks`` hold at least :meth:`key_tensors`. Default: decode both and drop the values."""
        return self.decode(slots, blocks, row_scales, dtype)[0]

    def kv_operands(self, slots: dict, groups: dict, scales: dict) -> tuple[KVOperand, KVOperand]:
        """Keys and values of a whole pool as the decode-attention op reads them in place.

        ``slots``/``groups``: the pool's flat per-slot and per-group tensors; ``scales``: what
        :meth:`attention_scales` made of the store's per-sequence scales of this format.
        A third-party codec that does not say gets an error naming it (no silent dense fallback)."""
        raise TypeError(f"storage format {type(self).__name__} ({self.name!r}) does not define kv_operands, so the "
                        "fused decode attention cannot read it; implement it, or make caches with fused_attention=False")

    def check_errors(self) -> None:
        """Raise for bad input that earlier :meth:`encode` calls only recorded (formats that check
        on the device defer the check so that encoding never waits for the GPU); default: none."""

    def prepare(self, device) -> None:
        """Make now what :meth:`encode` keeps between calls (an error flag): static decode calls
        this when it fixes the capacity, so that no captured step makes it; default: nothing."""

    def error_flags(self) -> torch.Tensor | None:
        """The device tensor :meth:`check_errors` reads (non-zero: an error is pending), so a caller
        can test many codecs with one host synchronization; None if the codec records nothing."""
        return None

    def row_scale_layout(self, heads: int) -> dict[str, int]:
        """Per-sequence scales the store keeps (``{name: heads}``), fixed at a sequence's first encode."""
        return {}

    def init_row_scales(self, keys: torch.Tensor, values: torch.Tensor, sel: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sequence scales ``[B, H]`` from the ``sel``-selected first tokens of each row (``[B, N, H, D]``)."""
        return {}

    def attention_scales(self, row_scales: dict) -> dict[str, torch.Tensor]:
        """What :meth:`kv_operands` reads of the per-sequence scales (``{name: [B, H]}``); default:
        the scales themselves. The store computes it only when row scales change (a row's first
        encode), not at every decode step, so that work here costs no kernel per step."""
        return row_scales


class DenseCodec(SlotCodec):
    """The model's own dtype, unchanged (bf16/fp16/fp32)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    def slot_layout(self, heads, head_dim):
        return {"k": ((heads, head_dim), self.dtype), "v": ((heads, head_dim), self.dtype)}

    def encode(self, keys, values, row_scales):
        return {"k": keys.to(self.dtype), "v": values.to(self.dtype)}, {}

    def decode(self, slots, blocks, row_scales, dtype=None):
        return slots["k"], slots["v"]

    def key_tensors(self, names):
        return ["k"]

    def decode_keys(self, slots, blocks, row_scales, dtype=None):
        return slots["k"]

    def kv_operands(self, slots, groups, scales):
        return KVOperand("dense", slots["k"]), KVOperand("dense", slots["v"])
