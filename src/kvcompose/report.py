"""Memory and token accounting of a kvcompose cache, in one printable object.

Memory is stated on one basis: a full cache in a named dtype, bf16 by default, whatever
dtype the model computes in. A CPU run computes in fp32, but its users serve in bf16:
against an fp32 full cache every quantized format would look twice as small as it is.
On that basis the tensors the cache holds in the model's dtype (full-precision blocks,
the recent buffer) count at the basis dtype's width, which is exactly what the same
cache holds when the model runs in that dtype; quantized payload and metadata do not
change; so do the bits per value. The bytes as held in this run's own tensors are kept
in ``held_bytes`` for whoever needs them, but not printed: one basis, one set of figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def memory_dtype(basis) -> torch.dtype | None:
    """A memory basis (a torch float dtype, one of its names, or None / ``"model"`` for the
    model's own dtype) as a dtype or None; anything else is refused, naming what is accepted."""
    if basis is None or basis == "model":
        return None
    if isinstance(basis, torch.dtype) and basis in _DTYPES.values():
        return basis
    if isinstance(basis, str) and basis in _DTYPES:
        return _DTYPES[basis]
    raise ValueError(f"unknown memory basis {basis!r}; accepted: {sorted(_DTYPES)}, a torch float dtype, "
                     "or None / 'model' (the model's own dtype)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Report:
    """What a cache holds versus what a full cache of the same tokens would hold.

    Byte counts cover every layer, on the report's ``basis`` (see the module docstring).
    ``kv_bytes`` counts blocks in use (their empty slots included), per-slot metadata,
    block tables and the recent buffer; ``allocated_bytes`` adds the free blocks the pools
    keep for reuse (at most one per row and region in eager decoding; static decoding
    reserves its capacity up front). ``full_kv_bytes`` is K+V of every real token seen in
    the basis dtype. ``held_bytes``: in use, allocated and full as held in this run's
    dtype (``dtype``).
    """

    kv_bytes: int
    peak_kv_bytes: int
    allocated_bytes: int
    full_kv_bytes: int
    payload_bytes: int
    metadata_bytes: int
    buffer_bytes: int
    tokens_seen: list[int]  # real tokens per sequence (prompt + generated)
    tokens_kept: list[list[int]]  # [layer][sequence] live tokens held now
    evictions: int  # eviction events, summed over layers
    per_layer_bytes: list[int] = field(default_factory=list)
    avg_bits: float | None = None  # bits per value of the live tokens in blocks, on the basis; None: none in blocks
    thought_mix: dict = field(default_factory=dict)  # % of real tokens filed under each class
    refreshes: int = 0  # classifier refreshes
    steps: int = 0  # forward passes (prefill + decode steps)
    eviction_steps: int = 0  # forward passes in which a trigger fired and an evictor ran (even if it kept all)
    eviction_call_rate: float = 0.0  # eviction_steps / steps, in % (ThinKV Table 4's "call rate")
    time_s: dict | None = None  # seconds in attention / eviction / refresh (when cache.time_phases() is on)
    dtype: str = ""  # what the model computes in (the dtype of the full-precision tensors held)
    basis: str = ""  # the full cache's dtype that the byte counts and fractions are stated in
    held_bytes: dict = field(default_factory=dict)  # {"in_use", "allocated", "full"} as held, in ``dtype``
    # Block sharing (share pager): steps decided, blocks shared, share rate, filter time per step, and
    # memory_saving_ratio = bytes sharing saves / bytes in use without it (ReasonCache's memory saving ratio).
    sharing: dict = field(default_factory=dict)
    # Tensor parallelism: the byte counts above are this rank's (its KV heads); this adds the rank,
    # the number of ranks, and in_use / peak / allocated / full summed over every rank. Empty without.
    ranks: dict = field(default_factory=dict)

    @classmethod
    def from_cache(cls, cache) -> "Report":
        layers = [layer.store for layer in cache.layers if layer.store is not None]
        if not layers:
            basis = cache.memory_basis
            return cls(0, 0, 0, 0, 0, 0, 0, [], [], 0, [], basis=dtype_name(basis) if basis is not None else "")
        basis = cache.memory_basis or layers[0].dtype
        live_bits = live = 0
        for store in layers:
            for region in store.regions:
                n = int(region.live_tokens().sum())
                live_bits += n * _bits_per_value(store, region.pool, basis)
                live += n
        mems = [s.memory(basis) for s in layers]
        held = [s.memory() for s in layers]

        def total(key: str) -> int:
            return sum(m[key] for m in mems)

        return cls(
            kv_bytes=total("in_use"),
            peak_kv_bytes=max(cache.peak_kv_bytes, total("in_use")),
            allocated_bytes=total("allocated"),
            full_kv_bytes=total("full"),
            payload_bytes=total("payload"),
            metadata_bytes=total("metadata"),
            buffer_bytes=total("buffer"),
            tokens_seen=layers[0].tokens_seen.tolist(),
            tokens_kept=[s.live_tokens().tolist() for s in layers],
            evictions=sum(s.evictions + int(s.evictions_on_device) for s in layers),
            per_layer_bytes=[m["in_use"] for m in mems],
            avg_bits=live_bits / live if live else None,
            **cache.thoughts.report(),
            **cache.counters.report(),
            time_s=cache.timer.report(),
            dtype=dtype_name(layers[0].dtype),
            basis=dtype_name(basis),
            held_bytes={k: sum(m[k] for m in held) for k in ("in_use", "allocated", "full")},
            sharing=_sharing(cache, total("in_use"), total("saved_by_sharing")),
            ranks=_ranks(cache.heads, {"in_use": total("in_use"), "peak": max(cache.peak_kv_bytes, total("in_use")),
                                       "allocated": total("allocated"), "full": total("full")}),
        )

    @property
    def memory_fraction(self) -> float:
        """``kv_bytes / full_kv_bytes`` on the report's basis (1.0 for an empty cache)."""
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 1.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["memory_fraction"] = self.memory_fraction
        return out

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:8.2f} MiB"

        basis = f"a full {self.basis} cache of the same tokens" if self.basis else "the model's dtype"
        if not self.tokens_seen:
            return f"memory basis   {basis}\nKV in use      nothing: the cache has seen no tokens yet"
        kept = [sum(row) / len(row) for row in zip(*self.tokens_kept)] if self.tokens_kept else []
        lines = [f"memory basis   {basis}"]
        if self.dtype != self.basis:
            lines[0] += (f" (this run computes in {self.dtype}; what it holds at full precision counts at {self.basis} "
                         f"width, as a {self.basis} run holds it)")
        in_use = f"KV in use      {mib(self.kv_bytes)}  ({100 * self.memory_fraction:.1f}% of full"
        if self.memory_fraction > 1:  # say why, or it reads as compression that costs memory
            in_use += f": unfilled slots and metadata on top of {sum(self.tokens_seen)} tokens"
        lines += [
            in_use + ")",
            f"  payload      {mib(self.payload_bytes)}",
            f"  buffer       {mib(self.buffer_bytes)}",
            f"  metadata     {mib(self.metadata_bytes)}",
            f"KV peak        {mib(self.peak_kv_bytes)}",
            f"KV allocated   {mib(self.allocated_bytes)}  ({100 * self.allocated_bytes / max(self.full_kv_bytes, 1):.1f}"
            "% of full)",
            f"full cache     {mib(self.full_kv_bytes)}  ({self.basis})",
            f"tokens seen    {self.tokens_seen}",
            f"tokens kept    {[round(k, 1) for k in kept]} (per sequence, mean over layers)",
            f"evictions      {self.evictions} (events, summed over layers); "
            f"evictor ran on {self.eviction_call_rate:.2f}% of {self.steps} steps",
            f"avg bits       {self.avg_bits:.2f} per value in blocks ({self.basis} basis)" if self.avg_bits is not None
            else "avg bits       none yet: every kept token still waits in the recent buffer",
        ]
        if self.thought_mix and len(self.thought_mix) > 1:
            mix = ", ".join(f"{c} {p:.1f}%" for c, p in self.thought_mix.items())
            lines.append(f"thought mix    {mix} ({self.refreshes} refreshes)")
        if self.sharing:
            sh = self.sharing
            lines.append(f"sharing        {sh['shared_blocks']} of {sh['shareable_blocks']} sealed step blocks shared "
                         f"({sh['steps']} steps); saves {100 * sh['memory_saving_ratio']:.1f}% of memory; filter "
                         f"{sh['filter_ms_per_step']:.2f} ms per step (budget {sh['budget_ms_per_step']} ms)")
        if self.ranks:
            every = self.ranks["all_ranks_bytes"]
            lines.insert(1, f"this rank      {self.ranks['rank']} of {self.ranks['size']} tensor-parallel ranks; "
                            "the bytes below are its KV heads'")
            lines.append(f"all ranks      in use {mib(every['in_use'])}, peak {mib(every['peak'])}, "
                         f"allocated {mib(every['allocated'])}, full {mib(every['full'])}")
        if self.time_s:
            lines.append("time           " + ", ".join(f"{k} {v:.3f}s" for k, v in self.time_s.items()))
        return "\n".join(lines)


def _bits_per_value(store, pool, basis: torch.dtype) -> float:
    """Payload bits per value of ``pool``'s blocks, on the basis: a pool that holds the model's own
    dtype counts at the basis width (as the store's memory does); a quantized one as stored."""
    from .paging import DenseCodec

    values_per_block = pool.block_size * 2 * store.num_kv_heads * store.head_dim
    bits = 8 * pool.payload_bytes_per_block / values_per_block
    if isinstance(pool.codec, DenseCodec) and pool.codec.dtype == store.dtype:
        bits *= basis.itemsize / store.dtype.itemsize
    return bits


def _sharing(cache, in_use: int, saved: int) -> dict:
    """The sharing tracker's counts plus the memory saving ratio (empty without sharing)."""
    if getattr(cache, "sharing", None) is None:
        return {}
    return {**cache.sharing.report(), "saved_bytes": saved,
            "memory_saving_ratio": saved / (in_use + saved) if in_use + saved else 0.0}


def _ranks(heads, mine: dict[str, int]) -> dict:
    """Under tensor parallelism, this rank's place and the byte counts summed over all ranks
    (a collective: every rank builds its report at the same point)."""
    if not heads.sharded:
        return {}
    summed = heads.all_sum_values(list(mine.values()))
    return {"rank": heads.rank, "size": heads.size,
            "all_ranks_bytes": {k: int(v) for k, v in zip(mine, summed)}}
