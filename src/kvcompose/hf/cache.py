"""A transformers ``Cache`` that runs a kvcompose policy.

One :class:`KVComposeLayer` per decoder layer. ``update`` only tags the new keys
with their layer; the ``kvcompose`` attention function then calls
:meth:`~kvcompose.runtime.layer.LayerRuntime.attend`, which appends the tokens
(skipping padding), attends over the kept tokens by absolute position, records the
recent queries evictors need, and lets the policy compress. The cache reports tokens
*seen* to transformers, so positions stay right after eviction. This module only
adapts :mod:`kvcompose.runtime` to transformers' cache contract.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..distributed import LOCAL, HeadShards, head_shards_of
from ..policies import Policy
from ..runtime import CacheRuntime, LayerRuntime
from .attention import ATTENTION_NAME, LAYER_ATTR, UnsupportedModelError
from .model_check import check_model
from .streamer import TokenStreamer


class KVComposeLayer(LayerRuntime, CacheLayerMixin):
    """Cache layer: the runtime's layer (store and recent queries) under transformers' layer contract."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "KVComposeCache", layer_idx: int):
        CacheLayerMixin.__init__(self)
        LayerRuntime.__init__(self, cache, layer_idx)
        self._pending = False  # updated, and the kvcompose attention has not run yet

    # -------------------------------------------------- transformers contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = self.cache.policy.make_store(B, H, D, key_states.dtype, key_states.device)
        self.is_initialized = True

    @torch.compiler.disable  # fused decode steps compile the layers around it (kvcompose.hf.fusion)
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


class KVComposeCache(CacheRuntime, Cache):
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
        return cls(policy, num_layers, fused_attention=fused_attention, memory_basis=memory_basis, tokenizer=tokenizer,
                   heads=head_shards_of(model))

    def __init__(self, policy: "Policy", num_layers: int, fused_attention: bool = True,
                 memory_basis: "torch.dtype | str | None" = torch.bfloat16, tokenizer=None, heads: HeadShards = LOCAL):
        CacheRuntime.__init__(self, policy, fused_attention, memory_basis, tokenizer, heads)
        Cache.__init__(self, layers=[KVComposeLayer(self, i) for i in range(num_layers)])
        self.start()

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

    def token_streamer(self, attention_mask: torch.Tensor | None = None, then=None) -> TokenStreamer:
        """A streamer for ``model.generate(..., streamer=...)`` that calls :meth:`observe_tokens`
        with the prompt (``attention_mask``: the prompt's) and then with every new token.
        ``then``: another streamer to pass the tokens on to."""
        return TokenStreamer(self, attention_mask, then)

    def reset(self) -> None:
        """Empty every layer and the per-sequence state, ready for a new generation."""
        Cache.reset(self)
        self.start()
