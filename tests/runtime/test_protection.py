"""The tokens every eviction keeps (``runtime.compression.protected``), against their definition."""

import types

import pytest
import torch

from kvcompose.paging import StoreView
from kvcompose.runtime.compression import protected


def by_age(valid, positions, sinks, recent):
    """The definition, row by row: a live token's rank by position among the row's live tokens."""
    out = torch.zeros_like(valid)
    for b in range(valid.shape[0]):
        live = valid[b].nonzero()[:, 0]
        ranked = live[torch.argsort(positions[b, live])]
        out[b, ranked[:sinks]] = True
        out[b, ranked[max(len(ranked) - recent, 0):]] = True
    return out


@pytest.mark.parametrize("sinks,recent,prompt", [(0, 0, False), (0, 0, True), (2, 0, False), (0, 3, False),
                                                 (4, 5, True), (40, 0, False), (0, 40, False)])
def test_sinks_recent_and_prompt_are_kept_as_defined(sinks, recent, prompt):
    g = torch.Generator().manual_seed(sinks * 100 + recent)
    B, L = 5, 24
    positions = torch.stack([torch.randperm(60, generator=g)[:L] for _ in range(B)])  # distinct, in any column order
    valid = torch.rand(B, L, generator=g) < 0.7
    valid[1] = False  # an empty row
    valid[2, :3] = True
    positions = torch.where(valid, positions, -1)
    is_prompt = valid & (positions < 10)
    view = StoreView(None, None, positions, valid, None, None, 0)
    policy = types.SimpleNamespace(sinks=sinks, recent_tokens=recent, protect_prompt=prompt)
    expected = by_age(valid, positions, sinks, recent) | (is_prompt if prompt else torch.zeros_like(valid))
    assert torch.equal(protected(policy, view, is_prompt), expected & valid)
