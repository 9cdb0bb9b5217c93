"""TBE's per-segment sizes and classes, against their definition (a [B, L, S] membership)."""

import torch

from kvcompose.evictors.tbe import ThoughtEvictor


def test_segment_sizes_and_classes_match_the_membership_definition():
    g = torch.Generator().manual_seed(0)
    B, L, S = 4, 50, 6
    seg = torch.randint(-1, S + 2, (B, L), generator=g)  # -1: prompt; S and above: beyond the segments held
    gen = (seg >= 0) & (torch.rand(B, L, generator=g) < 0.8)
    classes = torch.randint(0, 3, (B, L), generator=g)
    seg[3] = -1  # a row without generated tokens
    gen[3] = False
    size, cls = ThoughtEvictor._segment_sizes_and_classes(seg, gen, classes, S)
    in_seg = (seg[:, :, None] == torch.arange(S)[None, None, :]) & gen[:, :, None]
    assert torch.equal(size, in_seg.sum(1))
    assert torch.equal(cls, torch.where(in_seg, classes[:, :, None], -1).amax(1))
    assert bool((cls[3] == -1).all()) and bool((size[3] == 0).all())
