"""One layer's compression after attention: trigger -> evictor -> pager.

The policy says what to do (its trigger, evictor, pager, budget and protected tokens);
these functions do it on a layer's store. The eager path asks the trigger after every
step (:func:`compress`); the static-shape path either evicts inside every step
(:func:`compress_in_place`) or runs :func:`compress` on the steps its schedule picked.
"""

from __future__ import annotations

import torch

from ..distributed import LOCAL, HeadShards
from ..evictors import EvictionContext
from ..evictors.base import keep_top
from ..paging import LayerStore, StoreView
from ..triggers import TriggerInput


def compress(layer, view: StoreView | None = None, scheduled: bool = False) -> bool:
    """Run trigger → evictor → pager on one layer. Returns True if it evicted.

    Without a ``view`` the trigger decides on counts read from slot metadata, and the
    dense view (which evictors score) is built only when it fires. ``scheduled`` (static
    decode, :attr:`~kvcompose.Policy.captures_eviction` policies): the schedule knows the
    trigger fires in some row, so the device is not asked (rows that do not fire keep
    every token), the eviction is counted on the device, and the step is replayed as a
    CUDA graph."""
    policy = layer.cache.policy
    if policy.evictor is None:
        return False
    store = layer.store
    keys = not policy.evictor.reads_keys_by_column  # else the evictor decodes the few columns it reads
    if scheduled and view is None:  # the view is built anyway: the counts come from it
        view = store.view(values=False, keys=keys)
    counts = trigger_input(policy, store, view)
    keep = policy.trigger.plan(counts)
    fired = policy.trigger.fires(counts, keep)
    if scheduled:
        keep = torch.where(fired, keep, counts.stored)
    elif not bool(fired.any()):
        return False
    view = view if view is not None else store.view(values=False, keys=keys)
    ctx = eviction_context(policy, store, view, keep, *layer.recent_queries(), layer.scaling, layer.cache.heads)
    policy.pager.compact(store, view, policy.evictor.select(ctx))
    if scheduled:
        layer.cache.counters.note_eviction_on_device(fired.any())
        layer.cache.note_memory(layer.layer_idx)
    return True


def compress_in_place(layer) -> None:
    """Static decode, :attr:`~kvcompose.Policy.evicts_in_place` policies: trigger, scores and
    selection on fixed-shape slot state, the evicted slots dropped in place (no host
    synchronization). Keeps the same tokens as :func:`compress`; only where they lie differs
    (no compaction)."""
    policy = layer.cache.policy
    store = layer.store
    if _drops_one_per_step(policy, store):
        source = policy.evictor.score_source
        evicted = store.evict_one(budget=policy.budget, sinks=policy.sinks, recent=policy.recent_tokens,
                                  protect_prompt=policy.protect_prompt,
                                  score_channel=None if source == "position" else source).any()
    else:
        evicted = _evict_in_place_by_rank(policy, store)
    layer.cache.counters.note_eviction_on_device(evicted)
    store.evictions_on_device += evicted


def _drops_one_per_step(policy, store: LayerStore) -> bool:
    """Whether :func:`compress_in_place` can use :meth:`LayerStore.evict_one`: a trigger that
    trims to the budget every step (a step adds one token, so a row drops at most one),
    scores from positions or one slot channel, and a store of one region."""
    channels = tuple(getattr(policy.evictor, "slot_channels", ()))
    return (policy.trigger.trims_every_step and policy.budget is not None and policy.evictor.score_source is not None
            and len(store.regions) == 1 and len(channels) <= 1
            and policy.evictor.score_source in ("position", *channels))


def _evict_in_place_by_rank(policy, store: LayerStore) -> torch.Tensor:
    """The general in-place eviction: ranks every slot (keep_top); returns whether any row evicted."""
    positions, valid, state = store.slot_state(tuple(getattr(policy.evictor, "slot_channels", ())))
    is_prompt = valid & (positions < store.prompt_columns)
    counts = _counts(policy, store, valid, is_prompt)
    plan = policy.trigger.plan(counts)
    fired = policy.trigger.fires(counts, plan)
    keep_count = torch.where(fired, plan, counts.stored)
    view = StoreView(None, None, positions, valid, None, None, 0)
    ctx = EvictionContext(keys=None, positions=positions, valid=valid, keep=keep_count,
                          protected=protected(policy, view, is_prompt), state=state,
                          prompt_columns=store.prompt_columns or 0, segment=policy.refresh)
    evicted = valid & ~keep_top(policy.evictor.scores(ctx), ctx, check=False)
    store.evict_in_place(evicted)
    return evicted.any()


def trigger_input(policy, store: LayerStore, view: StoreView | None = None) -> TriggerInput:
    """The per-row counts a trigger decides on (from ``view``, or from the store's slot metadata)."""
    positions, valid, _ = store.slot_state() if view is None else (view.positions, view.valid, None)
    return _counts(policy, store, valid, valid & (positions < (store.prompt_columns or 0)))


def _counts(policy, store: LayerStore, valid: torch.Tensor, is_prompt: torch.Tensor) -> TriggerInput:
    return policy.trigger_input(valid.sum(1), is_prompt.sum(1), store.tokens_seen - store.prompt_tokens)


def eviction_context(policy, store: LayerStore, view: StoreView, keep: torch.Tensor,
                     queries: torch.Tensor | None = None, query_positions: torch.Tensor | None = None,
                     scaling: float = 1.0, heads: HeadShards = LOCAL) -> EvictionContext:
    """Everything the evictor sees for one layer: keys, positions, protection, queries, slot channels."""
    is_prompt = view.valid & (view.positions < store.prompt_columns)
    return EvictionContext(
        keys=view.keys,
        positions=view.positions,
        valid=view.valid,
        keep=keep,
        protected=protected(policy, view, is_prompt),
        queries=queries,
        query_valid=None if query_positions is None else query_positions >= 0,
        query_positions=query_positions,
        scaling=scaling,
        state={name: store.channel(name, view) for name in getattr(policy.evictor, "slot_channels", ())},
        classes=view.classes,
        class_names=tuple(policy.classes),
        prompt_columns=store.prompt_columns or 0,
        segment=policy.refresh,
        columns_limit=store.columns_limit if store.static else None,
        check=not store.static,
        heads=heads,
        keys_at=lambda rows, cols: store.keys_at(view, rows, cols),
    )


def protected(policy, view: StoreView, is_prompt: torch.Tensor) -> torch.Tensor:
    """Tokens no evictor may drop: sinks, the most recent tokens, and (optionally) the prompt.

    A row's live positions are distinct, so its ``sinks`` oldest tokens are those at or before
    its ``sinks``-th smallest position, and its ``recent_tokens`` newest those at or after its
    ``(live - recent_tokens + 1)``-th: one sort of the positions, none without sinks or recent."""
    keep = is_prompt if policy.protect_prompt else torch.zeros_like(view.valid)
    if policy.sinks or policy.recent_tokens:
        L = view.valid.shape[1]
        big = torch.iinfo(torch.long).max
        ordered = torch.sort(torch.where(view.valid, view.positions, big), dim=1).values  # live ones first
        if policy.sinks:
            keep = keep | (view.positions <= ordered[:, min(policy.sinks, L) - 1:min(policy.sinks, L)])
        if policy.recent_tokens:
            first = (view.valid.sum(1, keepdim=True) - policy.recent_tokens).clamp(0, L - 1)
            keep = keep | (view.positions >= ordered.gather(1, first))
    return keep & view.valid
