"""The storage formats the paged attention decodes, and the types that describe a layer's sources.

Formats (``KVOperand.fmt``): ``dense`` (bf16/fp16/fp32 as stored), ``fp8`` (E4M3 codes
times a per-(row, head) scale), ``nvfp4`` and ``ternary`` (codes, an E4M3 scale per 16
channels, a per-(row, head) second-level scale), ``int`` (asymmetric INT-k with a
scale and minimum per channel group of one token) and ``int_channel`` (KIVI keys:
scale and minimum per channel over ``token_group`` consecutive slots of a block).

A *source* (:class:`PagedSource`) is a pool of blocks in one storage format, addressed
per row through a block table, with a validity bit per slot (evicted, padding and empty
slots are off); the dense recent buffer is one more source. A source may carry a decoded
copy of its slots (:attr:`PagedSource.decoded`), which the plain-torch path reads instead of
decoding (see :func:`~kvcompose.ops.paged_attention.paged_decode_attention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


#: Storage formats the op decodes, and their kernel codes (``FMT`` constexpr).
FORMATS = {"dense": 0, "fp8": 1, "nvfp4": 2, "ternary": 3, "int": 4, "int_channel": 5}


#: Codes per byte of the packed formats (``int`` and ``int_channel``: ``8 // bits``).
_PER_BYTE = {"dense": 1, "fp8": 1, "nvfp4": 2, "ternary": 4}


#: Formats whose every stored value times its block scale is exact in fp16 (an E4M3 value,
#: or an E2M1 or ternary level times an E4M3 block scale: at most 6 significant bits, and
#: within fp16's normal range): with a bf16 or fp16 model the kernel feeds these tiles to
#: the tensor cores in fp16, with the queries in fp16 after a power-of-two shift per
#: program (exact for a bf16 query) and the probabilities in fp16, and applies the
#: per-(row, head) scale to the dot products in fp32. The reference rounds each decoded
#: value to the model dtype instead; the kernel's products are the exact ones.
EXACT_FORMATS = ("fp8", "nvfp4", "ternary")


@dataclass
class KVOperand:
    """Keys or values of one source in their storage format.

    ``codes``: per-slot payload ``[slots, H, D / codes per byte]`` (``dense``: the values
    themselves ``[slots, H, D]``). ``scale``/``minimum``: ``nvfp4``/``ternary`` E4M3 block
    scales ``[slots, H, D/16]`` (no minimum); ``int`` fp16/fp32 ``[slots, H, D/group]``;
    ``int_channel`` ``[slots / token_group, H, D]``. ``head_scale``: fp32 ``[B, H]``
    second-level scale of each row and head (``fp8``, ``nvfp4``, ``ternary``).
    """

    fmt: str
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None
    bits: int = 0
    token_group: int = 1

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown KV storage format {self.fmt!r}; accepted: {', '.join(FORMATS)}")
        if self.fmt.startswith("int") and self.bits not in (2, 4, 8):
            raise ValueError(f"{self.fmt} operand: bits={self.bits!r}; accepted: 2, 4, 8")
        needs = {"fp8": ("head_scale",), "nvfp4": ("scale", "head_scale"), "ternary": ("scale", "head_scale"),
                 "int": ("scale", "minimum"), "int_channel": ("scale", "minimum")}.get(self.fmt, ())
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{self.fmt} operand needs {', '.join(missing)}")

    @property
    def per_byte(self) -> int:
        return 8 // self.bits if self.fmt.startswith("int") else _PER_BYTE[self.fmt]

    def head_dim(self) -> int:
        return self.codes.shape[-1] * self.per_byte


@dataclass
class PagedSource:
    """One pool's worth of a layer's kept tokens: row ``b``'s token ``t`` lives in slot
    ``table[b, t // block_size] * block_size + t % block_size`` (table entry -1: no block);
    a slot takes part only where ``valid[slot]`` is set.

    ``decoded``: optionally, keys and values ``[slots, H, D]`` of every slot already decoded
    (what :func:`~kvcompose.ops.paged_attention.decode_operand_torch` gives for each slot and
    the row that reads it); the store keeps them up to date with the codes."""

    key: KVOperand
    value: KVOperand
    table: torch.Tensor  # [B, W] integer block ids
    block_size: int
    valid: torch.Tensor  # [slots] bool
    decoded: tuple[torch.Tensor, torch.Tensor] | None = None
    extent: torch.Tensor | None = None  # [B]: columns beyond extent[b] hold no valid slot of row b

    def with_decoded(self, dtype: torch.dtype) -> PagedSource:
        """This source with its decoded copy as dense operands, where it has one in ``dtype``."""
        if self.decoded is None or self.decoded[0].dtype != dtype:
            return self
        k, v = self.decoded
        return PagedSource(KVOperand("dense", k), KVOperand("dense", v), self.table, self.block_size, self.valid,
                           extent=self.extent)

    @property
    def tokens(self) -> int:
        """Token columns per row (``W * block_size``)."""
        return self.table.shape[1] * self.block_size

    def slots(self) -> torch.Tensor:
        """``[B, tokens]`` slot of every token column, -1 where the block is missing."""
        bs = self.block_size
        t = torch.arange(self.tokens, device=self.table.device)
        blk = self.table.long()[:, t // bs]
        return torch.where(blk >= 0, blk * bs + t % bs, -1)


def head_major_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` ``[S, H, ...]`` is a view of contiguous ``[H, S, ...]`` storage (and not also contiguous)."""
    return t.dim() >= 3 and not t.is_contiguous() and t.transpose(0, 1).is_contiguous()


def to_head_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` ``[S, H, ...]`` in head-major storage, seen through the same ``[S, H, ...]`` shape."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def per_slot_tensors(op: KVOperand) -> dict[str, torch.Tensor]:
    """An operand's tensors with one row per slot and head (``[slots, H, ...]``): its codes, and
    the scales and minimums of the formats that keep them per slot (not KIVI's per-group ones)."""
    out = {"codes": op.codes}
    if op.fmt in ("nvfp4", "ternary", "int"):
        out["scale"] = op.scale
    if op.fmt == "int":
        out["minimum"] = op.minimum
    return out


def row_layout(src: PagedSource) -> int:
    """How a source's (slot, head) rows lie in its per-slot tensors: 0 when **slot-major** (row
    ``slot * H + head``, a slot's heads side by side) or ``S`` when **head-major** (row
    ``head * S + slot`` for ``S`` slots: each head's rows together, so that one head's slots of a
    block are one contiguous run, what a program of the decode attention reads). Every per-slot
    tensor of both operands must lie the same way with contiguous rows; anything else is an error
    that names the tensor (the kernels address rows by these two rules only)."""
    kinds = {}
    for role, op in (("key", src.key), ("value", src.value)):
        for name, t in per_slot_tensors(op).items():
            if t.dim() != 3:
                raise ValueError(f"{role} {name} of shape {tuple(t.shape)}; accepted: [slots, H, ...] (3 dims)")
            S, H, X = t.shape
            st = t.stride()
            slot_major = (st[1] == X or H == 1) and (st[0] == H * X or S <= 1) and (st[2] == 1 or X == 1)
            head_major = (st[0] == X or S <= 1) and (st[1] == S * X or H == 1) and (st[2] == 1 or X == 1)
            if not (slot_major or head_major):
                raise ValueError(f"{role} {name} of shape {tuple(t.shape)} has strides {st}; accepted: slot-major "
                                 f"rows ({H * X}, {X}, 1) or head-major rows ({X}, {S * X}, 1)")
            if not (slot_major and head_major):
                kinds[f"{role} {name}"] = ("slot", 0) if slot_major else ("head", S)
    if len(set(kinds.values())) > 1:
        found = ", ".join(f"{t}: {k}-major" + (f" over {s} slots" if s else "") for t, (k, s) in kinds.items())
        raise ValueError(f"a source's per-slot tensors must lie one way (all slot-major, or all head-major over the "
                         f"same slots); got {found}")
    return next(iter(kinds.values()))[1] if kinds else 0


def head_major(src: PagedSource) -> PagedSource:
    """``src`` with its per-slot tensors copied into head-major storage (``[H, slots, ...]``, read
    through ``[slots, H, ...]`` views; see :func:`row_layout`): the same values, each head's rows
    together."""
    def moved(op: KVOperand) -> KVOperand:
        tensors = {name: to_head_major(t) for name, t in per_slot_tensors(op).items()}
        return dataclasses.replace(op, **tensors)

    return dataclasses.replace(src, key=moved(src.key), value=moved(src.value))
