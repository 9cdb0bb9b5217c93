"""The static-shape decode schedule: what each decode step does, known on the host in advance.

Every decode step adds one token to every row of every layer, so from the counts read at
one synchronization the host can run the policy's own trigger on each later step's
counts, and say which steps move a buffer group into blocks (``flush``), which evict or
refresh inside a captured graph, and which must run eagerly. The same trigger input
(:meth:`~kvcompose.Policy.trigger_input`) serves the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIMULATION_CHUNK = 256  # decode steps whose trigger decisions the schedule evaluates at once


@dataclass
class StepPlan:
    """What one decode step does besides appending and attending."""

    flush: bool  # some row's recent buffer fills: its oldest group is encoded into blocks
    eager: bool  # a trigger fires for an evictor, or a refresh comes for a classifier, that is not graph-safe
    evict: bool = False  # a trigger fires and the policy's eviction is graph-safe: evict inside the step
    refresh: bool = False  # the classifier refreshes and is graph-safe: classify inside the step

    @property
    def graph_key(self) -> tuple[bool, bool, bool]:
        """Steps with the same key replay the same captured graph."""
        return self.flush, self.evict, self.refresh


def static_capacity(policy, prompt_columns: int, max_new_tokens: int, kept: int | None = None) -> int:
    """Tokens per row and region that static decode reserves: the whole sequence for policies
    without a bound, else the budget (or what the prefill kept, or what the evictor cannot
    remove, if larger, its protected newest tokens included) plus what the trigger lets a row
    gain before it acts, plus one buffer group. ``kept``: the most tokens a row holds after the
    prefill (slots written and buffered; default: the whole prompt), so that a prompt the policy
    already cut to its budget reserves the budget, not the prompt."""
    full = prompt_columns + max_new_tokens
    if policy.evictor is None or policy.budget is None:
        return full
    none = torch.zeros(1, dtype=torch.long)
    head = policy.trigger.headroom(policy.trigger_input(none, none, none))
    if head is None:
        return full
    floor = policy.evictor.min_kept(prompt_columns, max_new_tokens, policy.refresh)
    if floor:  # a floor of the evictor's own (TBE's): the protected newest tokens stay whole on top of it
        floor += policy.recent_tokens
    start = prompt_columns if kept is None else kept
    return min(full, max(start, policy.budget, floor) + head + policy.group_size)


class Schedule:
    """Which decode steps flush a buffer group and which must run eagerly, known in advance.

    Every decode step adds one token to every row of every layer, so from the counts read
    at one synchronization (after the prefill and after each eager step) the host knows
    each later step's counts and evaluates the policy's trigger on them."""

    def __init__(self, cache, steps: int):
        self.cache = cache
        self.policy = cache.policy
        self.stores = [layer.store for layer in cache.layers]
        self.remaining = steps
        self.buffer_slots = self.stores[0].buf_k.shape[1]
        self.group = self.stores[0].group_size
        self.sync()

    def sync(self) -> None:
        """Read the buffer fill and the trigger's counts from the device (one synchronization)."""
        self.buffered = torch.stack([s.buf_len for s in self.stores]).cpu()  # [layers, B]
        self.since_sync = 0
        self.fires_at = self._next_firing()

    def _next_firing(self) -> int | None:
        """Steps after this sync until the trigger fires in some layer and row (None: not within the run)."""
        if self.policy.evictor is None or self.policy.evicts_in_place:
            return None  # nothing to evict, or evicted inside every step
        counts = [s.counts() for s in self.stores]
        stored = torch.stack([c[0] for c in counts]).cpu()
        prompt = torch.stack([c[1] for c in counts]).cpu()
        generated = torch.stack([s.tokens_seen - s.prompt_tokens for s in self.stores]).cpu()
        for start in range(0, self.remaining, SIMULATION_CHUNK):
            k = torch.arange(start + 1, min(start + SIMULATION_CHUNK, self.remaining) + 1)[:, None, None]
            later = self.policy.trigger_input(stored + k, prompt.expand(len(k), -1, -1), generated + k)
            fires = self.policy.trigger.fires(later, self.policy.trigger.plan(later)).flatten(1).any(1)
            if bool(fires.any()):
                return start + 1 + int(fires.nonzero()[0])
        return None

    def next(self) -> StepPlan:
        """The plan of the next step (call after the host counters of that step advanced)."""
        self.since_sync += 1
        self.remaining -= 1
        self.buffered += 1
        full = self.buffered == self.buffer_slots
        self.buffered -= full.long() * self.group
        refresh = self.cache.thoughts.is_refresh_step(self.stores[0])
        fires = self.since_sync == self.fires_at
        eager = (refresh and not self.policy.captures_refresh) or (fires and not self.policy.captures_eviction)
        return StepPlan(flush=bool(full.any()), eager=eager, evict=fires and not eager, refresh=refresh and not eager)
