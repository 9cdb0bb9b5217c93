"""A transformers ``Cache`` backed by the kvcompose paged store.

One :class:`KVComposeLayer` per decoder layer. ``update`` only tags the new keys
with their layer; the ``kvcompose`` attention function then calls
:meth:`KVComposeLayer.attend`, which appends the tokens (skipping padding), attends
over the kept tokens by absolute position, records the recent queries evictors need,
and lets the policy compress. The cache reports tokens *seen* to transformers, so
positions stay right after eviction. All per-sequence state lives here and starts
empty with every new cache.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from ..ops.paged_attention import paged_decode_attention
from ..paging import LayerStore, StoreView
from ..report import memory_dtype
from .attention import ATTENTION_NAME, LAYER_ATTR, CacheReuseError, UnsupportedModelError
from .counters import StepCounters
from .model_check import check_model
from .owner import OwningCache
from .sharing import SharingTracker
from .thoughts import ThoughtTracker
from .tokens import TokenStream, TokenStreamer
from .timing import PhaseTimer

if TYPE_CHECKING:
    from ..policies import Policy


class KVComposeLayer(CacheLayerMixin):
    """Cache layer: one :class:`LayerStore` plus the recent queries of this layer."""

    cache = OwningCache()  # weak: the cache owns this part

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "KVComposeCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.store: LayerStore | None = None
        # the last W queries [B, Hq, W, D] and their positions [B, W] (-1 for padding): oldest
        # first while decoding eagerly, a ring (column c at slot c % W) in static mode
        self.queries: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None
        self.scaling = 1.0
        self._pending = False

    # -------------------------------------------------- transformers contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = self.cache.policy.make_store(B, H, D, key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self._pending:
            raise UnsupportedModelError(
                f"layer {self.layer_idx} was updated twice without the kvcompose attention running in between: "
                f"load the model with attn_implementation='{ATTENTION_NAME}' (policy.generate does this for you)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.layer_idx == 0 and self.cache.step_plan is None:
            self.cache.check_errors()  # once per forward pass: what the previous one's encodes recorded
        setattr(key_states, LAYER_ATTR, self)
        self._pending = True
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.store.columns_seen if self.store is not None else 0

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # Our mask function passes the 2D padding mask through untouched, so only
        # the length bookkeeping of transformers reads these numbers.
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.queries = self.query_positions = None
        self.is_initialized = False
        self._pending = False

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("kvcompose caches do not support beam search (use num_beams=1)")

    def crop(self, max_length: int) -> None:
        raise ValueError("kvcompose caches cannot be cropped (assisted/speculative decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            raise ValueError("kvcompose caches cannot be expanded after prefill; pass one row per sequence")

    def batch_select_indices(self, indices) -> None:
        if self.get_seq_length() > 0:
            raise ValueError("kvcompose caches cannot drop rows after prefill")

    # ---------------------------------------------------------- the real work
    def attend(self, query, key, value, real, scaling: float, columns: int | None = None) -> torch.Tensor:
        """Store the new tokens, attend over the kept ones, then let the policy compress.

        Decode steps (one query per row) read the store in place through the fused paged
        attention; the dense view is built only for prefill, for evictions, for classifier
        refreshes and for observers (the fidelity harness). ``columns``: the width of the
        caller's 2D attention mask, which must be the columns seen so far plus the new ones.
        """
        self._pending = False
        self._check_continues(columns, key.shape[2])
        self.scaling = scaling
        policy = self.cache.policy
        store = self.store
        thoughts = self.cache.thoughts
        plan = self.cache.step_plan
        if plan is not None:  # a decode step of the static-shape path (see kvcompose.hf.static)
            if real is not None or query.shape[2] != 1:
                raise ValueError("static decode appends one real token per row and takes no attention mask")
            if self.layer_idx == 0:
                self.cache.counters.begin_forward_on_device()
            ring = (query, self.queries, self.query_positions) if policy.query_window > 0 else None
            positions = store.append_step(key, value, thoughts.step_classes(self.layer_idx), plan.flush, ring)
        else:
            if self.layer_idx == 0:
                self.cache.counters.begin_forward()
                if policy.needs_text:
                    self.cache.tokens.check_covers(store.columns_seen + key.shape[2],
                                                   f"policy {policy.name!r}: {policy.needs_text}")
            store.check_input(key, value)  # before the thought classes index rows by batch
            cls = thoughts.classes_for(self.layer_idx, key.shape[0], key.shape[2], real, key.device)
            positions = store.append(key, value, real, cls)
            if real is not None:
                positions = torch.where(real, positions, -1)
            self._record_queries(query, positions, policy.query_window)
        if plan is None or plan.flush or plan.eager:  # a static step changes memory only when it flushes
            self.cache._note_memory(self.layer_idx)
        fused = self.cache.fused_attention and query.shape[2] == 1 and not self.cache.observers
        view = None if fused else store.view()
        with self.cache.timer.phase("attention"):
            if fused:
                out = self._paged_attention(query, positions, scaling)
            else:
                out = self._attention(query, view, positions, scaling)
        in_place = plan is not None and policy.evicts_in_place  # evicts inside every static step
        if in_place:
            policy.compress_in_place(self)
        if plan is not None and not plan.eager:  # the schedule says what else happens this step
            if plan.refresh:
                view = store.view() if thoughts.needs_view(self.layer_idx, store) else None
                thoughts.observe(self.layer_idx, query, view, scaling, store)
            if plan.evict:
                with self.cache.timer.phase("eviction"):
                    policy.compress(self, view, scheduled=True)
            return out.transpose(1, 2).contiguous()
        if view is None and thoughts.needs_view(self.layer_idx, store):
            view = store.view()
        thoughts.observe(self.layer_idx, query, view, scaling, store)
        for observer in self.cache.observers:
            observer(self.layer_idx, query, view, positions, scaling)
        with self.cache.timer.phase("eviction"):
            evicted = not in_place and policy.compress(self, view)
        if evicted:
            self.cache.counters.note_eviction()
            self.cache._note_memory(self.layer_idx)
        if self.cache.sharing is not None and self.layer_idx == len(self.cache.layers) - 1:
            with self.cache.timer.phase("sharing"):
                shared = self.cache.sharing.after_forward()
            for layer in self.cache.layers if shared else ():  # shared blocks count once from now on
                self.cache._note_memory(layer.layer_idx)
        return out.transpose(1, 2).contiguous()

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

    def _paged_attention(self, query, positions, scaling):
        """The fused decode attention over the store's blocks and buffer (no dense view)."""
        evictor = self.cache.policy.evictor
        backend = self.cache.attention_backend
        if evictor is not None and evictor.mass_channel is not None:
            sources, channels = self.store.attention_sources_with(evictor.mass_channel)
            weight = (positions[:, -1] >= 0).float()  # padding queries add nothing
            return paged_decode_attention(query, sources, scaling, mass=(channels, weight), backend=backend)
        sources = self.store.attention_sources()
        if evictor is None or not evictor.needs_probs:
            return paged_decode_attention(query, sources, scaling, backend=backend)
        out, probs = paged_decode_attention(query, sources, scaling, probs=True, backend=backend)
        probs = probs[:, :, None, :] * (positions >= 0)[:, None, :, None]  # padding queries receive nothing
        _, valid, _ = self.store.slot_state()
        for name, d in (evictor.observe(probs, valid) or {}).items():
            self.store.add_to_slots(name, d)
        return out

    def _attention(self, query, view, positions, scaling):
        """SDPA over the dense view, or explicit probabilities when the evictor accumulates them."""
        policy = self.cache.policy
        store = self.store
        mask = view.valid[:, None, None, :] & (view.positions[:, None, None, :] <= positions[:, None, :, None])
        # Padding queries see nothing; let them attend anywhere (their output is never used).
        mask = mask | ~mask.any(-1, keepdim=True)
        if policy.evictor is not None and policy.evictor.needs_probs:
            out, delta = _attention_observed(query, view, mask, positions, scaling, policy.evictor.observe)
            for name, d in delta.items():
                store.add_to_channel(name, view, d)
        else:
            out = F.scaled_dot_product_attention(
                query, view.keys, view.values, attn_mask=mask, scale=scaling,
                enable_gqa=query.shape[1] != view.keys.shape[1],
            )
        return out

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
        self.store.fix_capacity(tokens, columns_limit)
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
        order = (self.store.column + torch.arange(window, device=self.queries.device)) % window
        return self.queries.index_select(2, order), self.query_positions.index_select(1, order)


#: fp32 probabilities an accumulating evictor's attention holds at once (see :func:`_attention_observed`).
PROBS_CHUNK_BYTES = 256 * 2**20


def _attention_observed(query, view, mask, positions, scaling, observe):
    """Plain attention for evictors that accumulate what it gives (``h2o``): the output and the
    summed per-slot increments ``observe`` makes of the probabilities. The queries go in chunks
    whose fp32 probabilities take at most :data:`PROBS_CHUNK_BYTES` (with the logits and the
    cast for the values about 2.5 times that): whole, a prefill's would take ``B x Hq x T x L x 4``
    bytes per layer (8.6 GB per row at 8K tokens and 32 query heads), several times over.
    ``observe`` is additive over queries (the :meth:`Evictor.observe` contract)."""
    B, Hq, T, _ = query.shape
    group = Hq // view.keys.shape[1]
    k = view.keys.repeat_interleave(group, dim=1)
    v = view.values.repeat_interleave(group, dim=1)
    rows = max(1, PROBS_CHUNK_BYTES // (B * Hq * k.shape[2] * 4))
    outs, total = [], {}
    for s in range(0, T, rows):
        logits = (query[:, :, s:s + rows] @ k.transpose(-1, -2)).float() * scaling
        probs = logits.masked_fill_(~mask[:, :, s:s + rows], float("-inf")).softmax(-1)
        outs.append(probs.to(v.dtype) @ v)
        probs *= (positions[:, s:s + rows] >= 0)[:, None, :, None]  # padding queries receive nothing
        for name, d in (observe(probs, view.valid) or {}).items():
            total[name] = total[name] + d if name in total else d
    return torch.cat(outs, dim=2), total


class KVComposeCache(Cache):
    """A transformers cache whose layers live in the kvcompose paged store."""

    @classmethod
    def for_model(cls, policy: "Policy", model, fused_attention: bool = True, memory_basis="bfloat16",
                  tokenizer=None) -> "KVComposeCache":
        """A fresh cache for ``model`` under ``policy`` (what :meth:`Policy.make_cache` returns):
        the model is checked, and a policy that reads the generated text needs its ``tokenizer``."""
        num_layers = check_model(model)
        if policy.needs_text and tokenizer is None:
            raise ValueError(f"Policy {policy.name!r}: {policy.needs_text} reads the generated text; pass "
                             "tokenizer= to make_cache (policy.generate passes its own)")
        return cls(policy, num_layers, fused_attention=fused_attention, memory_basis=memory_basis, tokenizer=tokenizer)

    def __init__(self, policy: "Policy", num_layers: int, fused_attention: bool = True,
                 memory_basis: "torch.dtype | str | None" = torch.bfloat16, tokenizer=None):
        self.policy = policy
        self.tokenizer = tokenizer  # decodes the token stream for components that read text
        # The dtype of the full cache that memory figures compare with (None: the model's own);
        # see kvcompose.report.
        self.memory_basis = memory_dtype(memory_basis)
        # Decode steps attend through the fused paged kernel (Triton on CUDA, its torch
        # reference elsewhere); False: always the dense view + SDPA (the eager reference).
        self.fused_attention = fused_attention
        self.attention_backend: str | None = None  # None: auto; "triton"/"torch" to force one
        # Callables ``(layer_idx, query, view, query_positions, scaling)`` run after each
        # attention, before compression: the fidelity harness reads attention through them.
        self.observers: list = []
        super().__init__(layers=[KVComposeLayer(self, i) for i in range(num_layers)])
        self._start()

    def __deepcopy__(self, memo) -> "KVComposeCache":
        """A copy (say, of a prompt's cache to reuse) whose layers and sharing tracker belong to
        the copy: they refer to their cache weakly, and a weak reference copies as itself.
        The static decoder of a finished run is not copied (it holds the model)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        memo[id(self.static_decoder)] = None
        new.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        for part in (*new.layers, new.sharing):
            if part is not None:
                part.cache = new
        return new

    def _start(self) -> None:
        self.timer = PhaseTimer()  # seconds per phase, when timing is on (time_phases)
        self.counters = StepCounters()
        self.tokens = TokenStream(self.tokenizer)  # ids fed through observe_tokens
        self.thoughts = ThoughtTracker(self.policy, len(self.layers), self.timer, self.tokens)
        self.sharing = SharingTracker(self) if self.policy.filter is not None else None
        # Static decode (kvcompose.hf.static) sets this to the current step's StepPlan.
        self.step_plan = None
        self.static_decoder = None  # the StaticDecoder of that path, for its counts of eager steps and replays
        self._in_use = [0] * len(self.layers)
        self._peak = 0
        self._in_use_device: torch.Tensor | None = None  # [layers] bytes, static mode (no host sync)
        self._peak_device: torch.Tensor | None = None

    def observe_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Give the cache the ids of the tokens the next forward pass appends (``[B, T]``; the
        mask marks padding, and may cover these columns or all so far). Policies whose
        components read the generated text need it before every forward; others ignore it."""
        self.tokens.observe(input_ids, attention_mask)

    def token_streamer(self, attention_mask: torch.Tensor | None = None, then=None) -> TokenStreamer:
        """A streamer for ``model.generate(..., streamer=...)`` that calls :meth:`observe_tokens`
        with the prompt (``attention_mask``: the prompt's) and then with every new token.
        ``then``: another streamer to pass the tokens on to."""
        return TokenStreamer(self, attention_mask, then)

    def reset(self) -> None:
        """Empty every layer and the per-sequence state, ready for a new generation."""
        super().reset()
        self._start()

    @property
    def peak_kv_bytes(self) -> int:
        """Most KV-cache bytes in use at once so far (all layers)."""
        if self._peak_device is None:
            return self._peak
        return max(self._peak, int(self._peak_device))

    def _note_memory(self, layer_idx: int) -> None:
        if self._in_use_device is not None:
            self._in_use_device[layer_idx] = self.layers[layer_idx].store.bytes_in_use(self.memory_basis)
            torch.maximum(self._peak_device, self._in_use_device.sum(), out=self._peak_device)
            return
        self._in_use[layer_idx] = self.layers[layer_idx].store.memory(self.memory_basis)["in_use"]
        self._peak = max(self._peak, sum(self._in_use))

    def fix_capacity(self, tokens: int, columns_limit: int | None = None) -> None:
        """Enter static mode after the prefill: every layer's store gets room for ``tokens``
        tokens per row now, and memory is tracked on the device from here on. ``columns_limit``:
        the most columns the run will have appended (see :meth:`LayerStore.fix_capacity`)."""
        device = self.layers[0].store.device
        self._in_use_device = torch.tensor(self._in_use, dtype=torch.long, device=device)
        self._peak_device = torch.tensor(self._peak, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.fix_capacity(tokens, columns_limit)

    def views(self) -> list[StoreView]:
        """Current dense views of every initialized layer (for inspection and tests)."""
        return [layer.store.view() for layer in self.layers if layer.store is not None]

    def check_errors(self) -> None:
        """Raise for NaN/inf keys or values, or bad input that quantized encoding recorded.

        Appending and encoding do not wait for the GPU to say whether their input was
        finite; the cache asks once per forward pass (and :func:`~kvcompose.hf.generate.generate`
        at the end), reading every layer's flags with one host synchronization, and the
        error names the first layer that has one.
        """
        layers = [layer for layer in self.layers if layer.store is not None]
        flags = [f for layer in layers for f in layer.store.error_flags()]
        if flags and int(torch.stack([f.reshape(()) for f in flags]).amax()):
            for layer in layers:
                layer.store.check_errors(f"layer {layer.layer_idx}")

    def time_phases(self, enabled: bool = True) -> None:
        """Measure wall time of attention, eviction and classifier refresh (synchronizes CUDA; slows decoding)."""
        self.timer.enable(enabled)

    def report(self):
        """Memory and token accounting so far (a :class:`kvcompose.report.Report`)."""
        from ..report import Report

        return Report.from_cache(self)
