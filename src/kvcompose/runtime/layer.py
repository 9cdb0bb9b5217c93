"""One layer's step: store the new tokens, attend over the kept ones, then compress.

:class:`LayerRuntime` is the part of a cache layer that runs the policy; the model
integration (``kvcompose.hf``) adds the framework's cache-layer contract around it.
A step is either eager (prefill, and decode steps driven by the framework: the host
reads counts and decides) or a step of the static-shape path, whose
:class:`~kvcompose.runtime.schedule.StepPlan` says in advance what it does besides
appending and attending.
"""

from __future__ import annotations

import torch

from ..paging import LayerStore
from ..ops.rotate_rows import rotate_rows, rotate_rows_fits
from ..rotations import SignedProduct, rotate
from .attention import dense_attention, paged_attention
from .compression import compress, compress_in_place
from .errors import CacheReuseError
from .owner import OwningCache


class LayerRuntime:
    """A layer's store plus the recent queries its evictor reads."""

    cache = OwningCache()  # weak: the cache owns this part

    def __init__(self, cache, layer_idx: int):
        self.cache = cache
        self.layer_idx = layer_idx
        self.store: LayerStore | None = None
        # the last W queries [B, Hq, W, D] and their positions [B, W] (-1 for padding): oldest
        # first while decoding eagerly, a ring (column c at slot c % W) in static mode
        self.queries: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None
        self.scaling = 1.0
        self.rotation_matrices = None  # built at the first step (see _rotation); False: none
        # the model's value and output projections carry the value rotation (kvcompose.hf.rotation_weights)
        self.rotation_in_weights = False

    def attend(self, query, key, value, real, scaling: float, columns: int | None = None) -> torch.Tensor:
        """Store the new tokens, attend over the kept ones, then let the policy compress.

        Decode steps (one query per row) read the store in place through the fused paged
        attention; the dense view is built only for prefill, for evictions, for classifier
        refreshes and for observers (the fidelity harness). ``columns``: the width of the
        caller's 2D attention mask, which must be the columns seen so far plus the new ones.
        """
        self._check_continues(columns, key.shape[2])
        rotation = self._rotation(key)
        if rotation is not None:  # stored, scored and attended rotated; the output is turned back
            forward, back, gain = rotation
            if self.rotation_in_weights:  # values come rotated, the output leaves rotated
                query, key = _rotated([query, key], forward)
                back = None
            else:
                query, key, value = _rotated([query, key, value], forward)
            scaling = scaling / gain  # (q S)(k S)^T = gain q k^T
        self.scaling = scaling
        plan = self.cache.step_plan
        if plan is None:
            positions = self._append_eager(query, key, value, real)
        else:
            positions = self._append_static(query, key, value, real, plan)
        if plan is None or plan.flush or plan.eager:  # a static step changes memory only when it flushes
            self.cache.note_memory(self.layer_idx)
        fused = self.cache.fused_attention and query.shape[2] == 1 and not self.cache.observers
        view = None if fused else self.store.view()
        with self.cache.timer.phase("attention"):
            out = paged_attention(self, query, positions, scaling) if fused else \
                dense_attention(self, query, view, positions, scaling)
        in_place = plan is not None and self.cache.policy.evicts_in_place  # evicts inside every static step
        if in_place:
            compress_in_place(self)
        if plan is not None and not plan.eager:
            self._scheduled_work(plan, query, view, scaling)
        else:
            self._after_eager_step(query, view, positions, scaling, evict=not in_place)
        if rotation is not None and back is not None:
            out = _rotated([out], back)[0]
        return out.transpose(1, 2).contiguous()

    def _rotation(self, key: torch.Tensor):
        """``(forward, back, gain)`` of the policy's rotation for this layer, in the keys' dtype and
        on their device, built at the first step (a prefill, never inside a captured step); None
        without a rotation. A matrix whose entries are all ``±1/sqrt(D)`` (Hadamard) is applied
        as its ``±1`` multiple ``S``, which any float dtype holds exactly: ``back = S^T / D`` and
        ``gain = D`` (a power of two here) are exact too, and the attention scale takes the gain.
        Other orthogonal matrices are applied as given (``gain = 1``). Under tensor parallelism
        the rank takes the matrices of the heads it holds (the group's ``rank``-th slice), so
        every head is rotated as in one process."""
        spec = self.cache.policy.rotation
        if spec is None:
            return None
        if self.rotation_matrices is None:
            heads, local = self.cache.heads, key.shape[1]
            m = spec.matrices(self.layer_idx, heads.total(local), key.shape[-1])
            m = None if m is None else m[heads.rank * local:(heads.rank + 1) * local]
            self.rotation_matrices = False if m is None else _exact_form(m, key.dtype, key.device)
        return self.rotation_matrices if self.rotation_matrices is not False else None

    def _append_eager(self, query, key, value, real) -> torch.Tensor:
        """Append a prefill or an eager step's tokens (padding skipped); returns their positions
        (``-1`` for padding) and records the queries the evictor reads."""
        cache, store = self.cache, self.store
        policy = cache.policy
        if self.layer_idx == 0:
            cache.counters.begin_forward()
            if policy.needs_text:
                cache.tokens.check_covers(store.columns_seen + key.shape[2],
                                          f"policy {policy.name!r}: {policy.needs_text}")
        store.check_input(key, value)  # before the thought classes index rows by batch
        cls = cache.thoughts.classes_for(self.layer_idx, key.shape[0], key.shape[2], real, key.device)
        positions = store.append(key, value, real, cls)
        if real is not None:
            positions = torch.where(real, positions, -1)
        self._record_queries(query, positions, policy.query_window)
        return positions

    def _append_static(self, query, key, value, real, plan) -> torch.Tensor:
        """Append one decode step's token per row in place (fixed shapes, no host synchronization)."""
        if real is not None or query.shape[2] != 1:
            raise ValueError("static decode appends one real token per row and takes no attention mask")
        cache = self.cache
        if self.layer_idx == 0:
            cache.counters.begin_forward_on_device()
        ring = (query, self.queries, self.query_positions) if cache.policy.query_window > 0 else None
        return self.store.append_step(key, value, cache.thoughts.step_classes(self.layer_idx), plan.flush, ring)

    def _scheduled_work(self, plan, query, view, scaling: float) -> None:
        """What the schedule says a captured static step does after attending: refresh the
        thought classes, evict."""
        thoughts = self.cache.thoughts
        if plan.refresh:
            view = self.store.view(values=False) if thoughts.needs_view(self.layer_idx, self.store) else None
            thoughts.observe(self.layer_idx, query, view, scaling, self.store)
        if plan.evict:
            with self.cache.timer.phase("eviction"):
                compress(self, view, scheduled=True)

    def _after_eager_step(self, query, view, positions, scaling: float, evict: bool) -> None:
        """An eager step's work after attending: thought classes, observers, eviction if the
        trigger fires, and (after the last layer) block sharing."""
        cache, store = self.cache, self.store
        if view is None and cache.thoughts.needs_view(self.layer_idx, store):  # fused attention: no observers
            view = store.view(values=False)
        cache.thoughts.observe(self.layer_idx, query, view, scaling, store)
        for observer in cache.observers:
            observer(self.layer_idx, query, view, positions, scaling)
        with cache.timer.phase("eviction"):
            evicted = evict and compress(self, view)
        if evicted:
            cache.counters.note_eviction()
            cache.note_memory(self.layer_idx)
        if cache.sharing is not None and self.layer_idx == len(cache.layers) - 1:
            with cache.timer.phase("sharing"):
                shared = cache.sharing.after_forward()
            for layer in cache.layers if shared else ():  # shared blocks count once from now on
                cache.note_memory(layer.layer_idx)

    def _check_continues(self, columns: int | None, new: int) -> None:
        seen = self.store.columns_seen
        if columns is not None and columns != seen + new:
            self._refuse_reuse(f"the attention mask covers {columns} columns for {new} new ones (expected {seen + new})")

    def check_positions(self, position_ids) -> None:
        """Without an attention mask, the new tokens of a used cache must start at the position after
        the columns it holds (a second ``generate`` on the same cache restarts them). Eager steps
        only: it reads the device (static decode steps are the cache's own and are not checked)."""
        seen = self.store.columns_seen if self.store is not None else 0
        if seen == 0 or self.cache.step_plan is not None or not isinstance(position_ids, torch.Tensor):
            return
        if position_ids.ndim != 2:  # e.g. multimodal rotary positions: not ours to read
            return
        first = position_ids[:, 0]
        if not bool((first == seen).all()):
            self._refuse_reuse(f"the new tokens start at position {first.tolist()} (expected {seen})")

    def _refuse_reuse(self, what: str) -> None:
        raise CacheReuseError(
            f"layer {self.layer_idx}: the cache already holds {self.store.columns_seen} columns, but {what}. A "
            "kvcompose cache serves one generation: make a new one with policy.make_cache(model), or call "
            "cache.reset() first"
        )

    def _record_queries(self, query: torch.Tensor, positions: torch.Tensor, window: int) -> None:
        """Eager steps: keep the last ``window`` queries (current step last) with their
        positions (-1: padding). Static steps write their ring in the buffer append."""
        if window <= 0:
            return
        if self.queries is None:
            B, Hq, _, D = query.shape
            self.queries = query.new_zeros(B, Hq, 0, D)
            self.query_positions = torch.zeros(B, 0, dtype=torch.long, device=query.device)
        # contiguous: a slice of the prefill's queries would keep all of them alive
        self.queries = torch.cat([self.queries, query], dim=2)[:, :, -window:].contiguous()
        self.query_positions = torch.cat([self.query_positions, positions], dim=1)[:, -window:].contiguous()

    def fix_capacity(self, tokens: int, columns_limit: int | None = None) -> None:
        """Static mode for this layer: the store's capacity, and a full query window (empty
        entries at the front carry position -1, as padding does) turned into a ring: the
        query of column ``c`` at slot ``c % W``."""
        self.store.fix_capacity(tokens, columns_limit, self.cache.policy.static_hole_blocks)
        window = self.cache.policy.query_window
        if window > 0 and self.queries is not None:
            missing = window - self.queries.shape[2]
            if missing > 0:
                self.queries = torch.cat([self.queries.new_zeros(*self.queries.shape[:2], missing,
                                                                 self.queries.shape[3]), self.queries], dim=2)
                self.query_positions = torch.cat([torch.full_like(self.query_positions[:, :1], -1).expand(
                    -1, missing), self.query_positions], dim=1)
            shift = self.store.columns_seen % window  # the newest, column columns_seen - 1, to its slot
            self.queries = self.queries.roll(shift, dims=2).contiguous()
            self.query_positions = self.query_positions.roll(shift, dims=1).contiguous()

    def recent_queries(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The recorded queries ``[B, Hq, W, D]`` and positions ``[B, W]``, oldest first (what
        evictors read); in static mode the ring is read from the slot after the newest."""
        if self.queries is None or not self.store.static:
            return self.queries, self.query_positions
        window = self.queries.shape[2]
        order = (self.store.column[:1] + torch.arange(window, device=self.queries.device)) % window
        return self.queries.index_select(2, order), self.query_positions.index_select(1, order)


def _rotated(tensors: list[torch.Tensor], matrices) -> list[torch.Tensor]:
    """``tensors`` rotated by ``matrices``: a decode step's in one launch where the rotation is a
    :class:`~kvcompose.rotations.SignedProduct` and the kernel runs (CUDA), else one
    :func:`~kvcompose.rotations.rotate` each."""
    if isinstance(matrices, SignedProduct) and rotate_rows_fits(tensors, matrices.signs):
        return rotate_rows(tensors, matrices.signs, matrices.matrix, matrices.signs_first)
    return [rotate(t, matrices) for t in tensors]


def _exact_form(m: torch.Tensor, dtype: torch.dtype, device) -> tuple:
    """``(forward, back, gain)`` of orthogonal matrices ``m`` (see :meth:`LayerRuntime._rotation`):
    a :class:`~kvcompose.rotations.SignedProduct` where the heads' ``±1`` matrices differ only by
    the signs of their rows (Hadamard with random signs), else per-head matrices."""
    D = m.shape[-1]
    signs = m * D ** 0.5
    if not torch.allclose(signs.abs(), torch.ones_like(signs), atol=1e-4):
        return m.to(device=device, dtype=dtype), m.transpose(-1, -2).to(device=device, dtype=dtype), 1.0
    s = signs.sign()
    row_signs = s[:, :, 0]  # each head's rows made to start with +1 give one shared matrix, if they share one
    shared = s[0] * row_signs[0][:, None]
    if torch.equal(row_signs[:, :, None] * shared, s):
        row_signs, shared = row_signs.to(device=device, dtype=dtype), shared.to(device=device, dtype=dtype)
        forward = SignedProduct(row_signs, shared, signs_first=True)
        back = forward.transposed()
        return forward, SignedProduct(back.signs, (back.matrix / D).contiguous(), back.signs_first), float(D)
    return s.to(device=device, dtype=dtype), (s.transpose(-1, -2) / D).to(device=device, dtype=dtype), float(D)
