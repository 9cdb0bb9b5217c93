"""A pool of fixed-size blocks of token slots, with a free list that is reused first.

The pool grows by exactly the blocks a request lacks and gives free blocks back
(:meth:`BlockPool.keep_only`), so what it allocates follows what its tokens need.

One pool holds blocks of one storage format (its :class:`SlotCodec`). Blocks are
handed out by id; a slot is addressed as ``block_id * block_size + offset``. The
payload tensors come from the codec; per-slot metadata lives beside them in named
channels (``pos``: absolute position, ``valid``: live bit, plus any float channel an
evictor asks for), so moving a token moves everything that belongs to it.

A pool of a quantized format may also keep a **decoded copy** of its slots (``decoded_dtype``):
each token's keys and values decoded once, when its group is encoded, in the model's dtype,
as two more per-slot tensors (:data:`DECODED`). Living among the per-slot tensors, the copy
moves, compacts, grows and shrinks with the codes by construction. It is scratch for the
plain-torch decode attention, not payload: the memory report leaves it out.
"""

from __future__ import annotations

import torch

from ..ops.paged_attention import decode_operand_torch
from ..ops.scatter_slots import write_slots
from .codec import SlotCodec

#: Per-slot tensors of a pool's decoded copy (keys, values ``[H, D]`` per slot in the model's dtype).
DECODED = ("k.decoded", "v.decoded")


def empty_value(channel: str) -> int:
    """What a per-slot metadata channel holds in an empty slot: -1 for ``pos``, else 0
    (``valid`` False, float channels 0)."""
    return -1 if channel == "pos" else 0


class BlockPool:
    """Blocks of ``block_size`` slots in one storage format."""

    def __init__(
        self,
        codec: SlotCodec,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        float_channels: tuple[str, ...] = (),
        refcounted: bool = False,
        decoded_dtype: torch.dtype | None = None,
        head_major: bool = False,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if codec.group_tokens > 1 and block_size % codec.group_tokens:
            raise ValueError(
                f"format {codec.name!r} encodes {codec.group_tokens} tokens together; block_size={block_size} "
                f"must be a multiple of {codec.group_tokens}"
            )
        self.codec = codec
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.capacity = 0
        self.head_major = head_major
        bs = block_size
        self.slots = {n: self._slot_tensor(0, s, d) for n, (s, d) in codec.slot_layout(num_kv_heads, head_dim).items()}
        self.decoded = decoded_dtype is not None
        for name in DECODED if self.decoded else ():
            self.slots[name] = self._slot_tensor(0, (num_kv_heads, head_dim), decoded_dtype)
        self.blocks = {n: torch.empty(0, bs // codec.group_tokens, *s, dtype=d, device=device)
                       for n, (s, d) in codec.block_layout(num_kv_heads, head_dim).items()}
        self.meta: dict[str, torch.Tensor] = {
            "pos": torch.empty(0, bs, dtype=torch.long, device=device),
            "valid": torch.empty(0, bs, dtype=torch.bool, device=device),
        }
        for name in float_channels:
            self.meta[name] = torch.empty(0, bs, dtype=torch.float32, device=device)
        self._free = torch.empty(0, dtype=torch.long, device=device)
        self.num_free = 0
        # Share pager: how many block-table entries reference each block; a block goes back
        # to the free list when its count reaches 0. None: every block has one owner.
        self.refs = torch.empty(0, dtype=torch.int32, device=device) if refcounted else None
        # Static mode (fixed capacity, see :meth:`fix_capacity`): the slot that masked-out
        # writes of a static-shape append go to; it belongs to no block table.
        self.trash_slot: int | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def payload_bytes_per_block(self) -> int:
        tensors = [t for n, t in self.slots.items() if n not in DECODED] + list(self.blocks.values())
        return sum(torch.Size(t.shape[1:]).numel() * t.element_size() for t in tensors)

    @property
    def decoded_bytes_per_block(self) -> int:
        """Bytes of the decoded copy per block (0 without one): scratch, in no memory report."""
        return sum(torch.Size(self.slots[n].shape[1:]).numel() * self.slots[n].element_size()
                   for n in DECODED if n in self.slots)

    @property
    def meta_bytes_per_block(self) -> int:
        per_slot = self.block_size * sum(t.element_size() for t in self.meta.values())
        return per_slot + (self.refs.element_size() if self.refs is not None else 0)

    @property
    def bytes_per_block(self) -> int:
        return self.payload_bytes_per_block + self.meta_bytes_per_block

    @property
    def blocks_in_use(self) -> int:
        return self.capacity - self.num_free

    def _slot_tensor(self, blocks: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """An empty per-slot tensor ``[blocks, block_size, H, ...]`` (``shape``: ``(H, ...)``). Head-major,
        it is a view of ``[H, blocks * block_size, ...]`` storage: one head's slots of a block are one
        run of bytes, what a program of the decode attention reads, and the flat slot view
        (:meth:`flat_slots`) is still a view."""
        bs = self.block_size
        if not self.head_major:
            return torch.empty(blocks, bs, *shape, dtype=dtype, device=self.device)
        heads, *rest = shape
        storage = torch.empty(heads, blocks * bs, *rest, dtype=dtype, device=self.device)
        return storage.view(heads, blocks, bs, *rest).movedim(0, 2)

    # ------------------------------------------------------------- flat views
    def flat_slots(self, tensors: dict[str, torch.Tensor], names=None) -> dict[str, torch.Tensor]:
        """Slot-indexed views (``[capacity * block_size, ...]``) of per-slot tensors (``names``: of those only)."""
        return {n: t.view(self.capacity * self.block_size, *t.shape[2:]) for n, t in tensors.items()
                if names is None or n in names}

    def flat_groups(self) -> dict[str, torch.Tensor]:
        """Group-indexed views of per-block tensors (a block holds ``block_size / group_tokens`` groups)."""
        return {n: t.view(-1, *t.shape[2:]) for n, t in self.blocks.items()}

    def write(self, slot: torch.Tensor, slots: dict, groups: dict, meta: dict) -> None:
        """Store ``M`` encoded tokens at pool slots ``slot`` ``[M]``: their per-slot tensors and
        metadata (``[M, ...]``), and their per-group tensors (``[M / group_tokens, ...]``) at
        the groups whose first slots they fill."""
        flats = [*self.flat_slots(self.slots).items(), *self.flat_slots(self.meta).items()]
        rows = [(slots if i < len(self.slots) else meta)[n].to(f.dtype) for i, (n, f) in enumerate(flats)]
        write_slots([f for _, f in flats], rows, slot)  # every tensor in one launch
        if groups:
            g = self.codec.group_tokens
            first = slot[::g] // g  # group index = first slot of the group / group size
            for name, flat in self.flat_groups().items():
                flat[first] = groups[name]

    # ------------------------------------------------------------ allocation
    def fix_capacity(self, blocks: int) -> None:
        """Grow once so that ``blocks`` more can be taken without growing again, plus one
        block whose first slot takes the masked-out writes of static-shape appends.
        After this the pool's tensors never move (what a captured CUDA graph needs)."""
        if self.trash_slot is None:
            self._grow(max(blocks + 1 - self.num_free, 0))
            self.trash_slot = int(self.allocate(1)[0]) * self.block_size
        elif blocks > self.num_free:
            raise ValueError(f"pool {self.codec.name!r}: capacity already fixed with {self.num_free} free blocks; "
                             f"{blocks} needed")

    def allocate(self, n: int) -> torch.Tensor:
        """Take ``n`` block ids, reusing freed blocks before growing the pool."""
        if n > self.num_free:
            if self.trash_slot is not None:
                raise ValueError(f"pool {self.codec.name!r}: its capacity is fixed (static decode) and {n} blocks "
                                 f"were asked for with {self.num_free} free")
            self._grow(n - self.num_free)
        ids = self._free[self.num_free - n : self.num_free].clone()
        self.num_free -= n
        if self.refs is not None:
            self.refs[ids] = 1
        return ids

    def add_refs(self, ids: torch.Tensor) -> None:
        """One more block-table entry references each of ``ids`` (repeats count)."""
        if self.refs is None:
            raise ValueError(f"pool {self.codec.name!r} does not count references; only the share pager shares blocks")
        self.refs.index_add_(0, ids, torch.ones_like(ids, dtype=self.refs.dtype))

    def release(self, ids: torch.Tensor, last: bool = False) -> None:
        """Drop one reference to each of ``ids`` (repeats count); blocks left unreferenced go
        back to the free list and their slots become empty. ``last=True``: the caller knows
        these are distinct blocks with one reference each, so all of them are freed without
        reading the counts back (no host synchronization)."""
        if ids.numel() and self.refs is not None:
            self.refs.index_add_(0, ids, torch.full_like(ids, -1, dtype=self.refs.dtype))
            if not last:
                if bool((self.refs[ids] < 0).any()):
                    raise ValueError(f"pool {self.codec.name!r}: a block was released more often than it was "
                                     "referenced (a kvcompose bug: please report it)")
                ids = torch.unique(ids[self.refs[ids] == 0])
        n = ids.numel()
        if n == 0:
            return
        self.meta["valid"][ids] = False
        self.meta["pos"][ids] = -1
        self._free[self.num_free : self.num_free + n] = ids
        self.num_free += n

    def keep_only(self, used: torch.Tensor) -> torch.Tensor:
        """Give back every block but ``used`` (the ids still referenced, each once): those move
        to ids ``0 .. len(used) - 1`` and the pool shrinks to them. Returns ``[old capacity]``
        mapping each old id to its new one (-1 for a block given back); the caller rewrites
        its block tables with it. Not in static mode, where the tensors must not move."""
        if self.trash_slot is not None:
            raise ValueError(f"pool {self.codec.name!r}: its capacity is fixed (static decode); it cannot shrink")
        remap = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        remap[used] = torch.arange(used.numel(), device=self.device)
        self.slots = {n: self._slot_tensor(used.numel(), t.shape[2:], t.dtype).copy_(t[used]) if self.head_major
                      else t[used] for n, t in self.slots.items()}
        self.blocks = {n: t[used] for n, t in self.blocks.items()}
        self.meta = {n: t[used] for n, t in self.meta.items()}
        if self.refs is not None:
            self.refs = self.refs[used]
        self.capacity = used.numel()
        self._free = torch.empty(self.capacity, dtype=torch.long, device=self.device)
        self.num_free = 0
        return remap

    def _grow(self, extra: int) -> None:
        old = self.capacity
        new = old + max(extra, 1)

        def grown(t: torch.Tensor, fill, per_slot: bool = False) -> torch.Tensor:
            out = self._slot_tensor(new, t.shape[2:], t.dtype) if per_slot else \
                torch.empty(new, *t.shape[1:], dtype=t.dtype, device=t.device)
            out[:old] = t
            out[old:] = fill
            return out

        self.slots = {n: grown(t, 0, per_slot=True) for n, t in self.slots.items()}
        self.blocks = {n: grown(t, 0) for n, t in self.blocks.items()}
        self.meta = {n: grown(t, empty_value(n)) for n, t in self.meta.items()}
        if self.refs is not None:
            self.refs = grown(self.refs, 0)
        # The free list is a stack; fresh ids go underneath so freed blocks are reused first.
        stack = torch.cat([torch.arange(new - 1, old - 1, -1, device=self.device), self._free[: self.num_free]])
        self._free = torch.empty(new, dtype=torch.long, device=self.device)
        self._free[: stack.numel()] = stack
        self.num_free += new - old
        self.capacity = new


def decoded_slots(codec: SlotCodec, slots: dict, groups: dict, token_scales: dict, dtype: torch.dtype) -> dict:
    """The :data:`DECODED` tensors ``[M, H, D]`` of ``M`` freshly encoded tokens (``slots`` and
    ``groups`` as :meth:`SlotCodec.encode` returns them, ``token_scales`` each token's row
    scales ``[M, H]``): decoded by the attention's own reference decode, so the copy holds
    bit for bit what decoding the codes at attention time gives."""
    key, value = codec.kv_operands(slots, groups, codec.attention_scales(token_scales))
    at = torch.arange(key.codes.shape[0], device=key.codes.device)  # token i is slot i and its own row
    return {DECODED[0]: decode_operand_torch(key, at, at, dtype),
            DECODED[1]: decode_operand_torch(value, at, at, dtype)}
