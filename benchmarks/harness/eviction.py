"""One layer right after attention, as :meth:`runtime.compression.compress` sees it, and the timed eviction step.

- :class:`Scenario` / :func:`build_state`: a layer holding ``candidates`` live tokens per sequence;
- :func:`evict`: the timed step (context + score + select + gather/compact);
- :func:`check_eviction`: the benchmark's step against ``runtime.compression.compress`` on the same state.

The state is built with the public store API (``LayerStore.append``, ``add_to_channel``)
from random keys, values and recorded queries. Random data is fine for speed: every
evictor does the same work whatever the values.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvcompose import Policy
from kvcompose.evictors import EvictionContext
from kvcompose.paging import LayerStore, StoreView
from kvcompose.runtime import compression

PRESETS = ("rkv", "snapkv", "h2o", "streamingllm", "rpc")
BUFFER = 128  # R-KV's buffer: candidates = budget + BUFFER, one eviction every BUFFER decode steps


@dataclass(frozen=True)
class Scenario:
    """One eviction of one layer: ``candidates`` live tokens per sequence, ``keep`` survive."""

    preset: str
    batch: int
    keep: int  # tokens each sequence keeps (the budget)
    candidates: int  # live tokens per sequence before the eviction
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    prompt: int = 64  # the first tokens were the prompt (rpc protects them)

    def describe(self) -> dict:
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out


@dataclass
class EvictionState:
    """One layer after attention, with the attributes of ``KVComposeLayer`` that ``runtime.compression.compress`` reads."""

    policy: Policy
    store: LayerStore
    view: StoreView
    keep: torch.Tensor  # [B] int64
    queries: torch.Tensor | None  # [B, Hq, W, D], oldest first; None when the evictor reads no queries
    query_positions: torch.Tensor | None  # [B, W]
    scaling: float

    @property
    def query_valid(self) -> torch.Tensor | None:
        return None if self.query_positions is None else self.query_positions >= 0

    @property
    def cache(self) -> SimpleNamespace:
        """The layer's cache as far as one eager compression reads it: its policy."""
        return SimpleNamespace(policy=self.policy)

    def recent_queries(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The recorded queries and their positions, oldest first (as an eager layer gives them)."""
        return self.queries, self.query_positions

    def fresh(self) -> "EvictionState":
        """A copy whose store can be compacted without touching this one (the view stays valid for it)."""
        return dataclasses.replace(self, store=copy.deepcopy(self.store))


def make_policy(scenario: Scenario) -> Policy:
    """The preset with its budget set to ``scenario.keep`` (rpc's interval trigger ignores the budget)."""
    return Policy.from_preset(scenario.preset, budget=scenario.keep)


def build_state(scenario: Scenario, device: torch.device | str, seed: int = 0) -> EvictionState:
    """A layer holding ``scenario.candidates`` random tokens per sequence (prompt first, then generated)."""
    s = scenario
    if not s.prompt < s.candidates or s.keep >= s.candidates:
        raise ValueError(f"need prompt < candidates and keep < candidates: {s}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=s.dtype)

    policy = make_policy(s)
    store = policy.make_store(s.batch, s.kv_heads, s.head_dim, s.dtype, device)
    for tokens in (s.prompt, s.candidates - s.prompt):  # prefill, then the generated tokens in one chunk
        shape = (s.batch, s.kv_heads, tokens, s.head_dim)
        store.append(randn(*shape), randn(*shape))
    view = store.view()
    for name in getattr(policy.evictor, "slot_channels", ()):  # h2o's accumulated attention
        store.add_to_channel(name, view, torch.rand(view.valid.shape, generator=gen, device=device))
    window = policy.query_window
    queries = positions = None
    if window:
        queries = randn(s.batch, s.q_heads, window, s.head_dim)
        last = store.columns_seen - window + torch.arange(window, device=device)
        positions = last.expand(s.batch, window).contiguous()
    keep = torch.full((s.batch,), s.keep, dtype=torch.long, device=device)
    return EvictionState(policy, store, view, keep, queries, positions, s.head_dim**-0.5)


def eviction_context(state: EvictionState) -> EvictionContext:
    """The context ``runtime.compression.compress`` builds (with ``keep`` given instead of planned by the trigger)."""
    return compression.eviction_context(
        state.policy, state.store, state.view, state.keep, state.queries, state.query_positions, state.scaling
    )


def evict(state: EvictionState) -> None:
    """The timed eviction step: build the context, score + select, gather the kept tokens (compact)."""
    policy = state.policy
    policy.pager.compact(state.store, state.view, policy.evictor.select(eviction_context(state)))


def kept_positions(store: LayerStore) -> torch.Tensor:
    """Sorted positions of the live tokens of each row, ``[B, n]`` (all rows must hold ``n``)."""
    view = store.view()
    big = torch.iinfo(torch.long).max
    pos = torch.where(view.valid, view.positions, big).sort(dim=1).values
    return pos[:, : int(view.valid.sum(1).max())]


def check_eviction(state: EvictionState) -> bool | None:
    """Run :func:`evict` on a copy and check it; returns whether it matches ``runtime.compression.compress``.

    Every row must keep exactly ``keep`` tokens. Where the preset's own trigger fires
    on this state (all but rpc), ``runtime.compression.compress`` must keep the same tokens, so
    the context built here cannot drift from the library's; None where it does not fire.
    """
    ours = state.fresh()
    evict(ours)
    live = ours.store.live_tokens()
    if not bool((live == state.keep).all()):
        raise AssertionError(f"{state.policy.name}: rows kept {live.tolist()} tokens, expected {state.keep.tolist()}")
    theirs = state.fresh()
    if not compression.compress(theirs, state.view):
        return None
    return bool(torch.equal(kept_positions(ours.store), kept_positions(theirs.store)))
