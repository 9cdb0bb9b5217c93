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


def test_the_step_down_levels_are_the_retention_chain():
    """Each segment's levels: its size, then the next retention value below, again and again
    (a size at or under the floor, or between values, steps as the chain of single steps)."""
    evictor = ThoughtEvictor(retention=[64, 32, 16, 8, 4])
    size = torch.tensor([[0, 1, 4, 5, 16, 17, 63, 64, 65, 128]])
    levels = evictor._levels(size)
    chain = [size]
    for _ in evictor.retention:
        chain.append(evictor._next(chain[-1]))
    assert torch.equal(levels, torch.stack(chain, -1))
    assert levels[0].tolist() == [[0] * 6, [1] * 6, [4] * 6, [5, 4, 4, 4, 4, 4], [16, 8, 4, 4, 4, 4],
                                  [17, 16, 8, 4, 4, 4], [63, 32, 16, 8, 4, 4], [64, 32, 16, 8, 4, 4],
                                  [65, 64, 32, 16, 8, 4], [128, 64, 32, 16, 8, 4]]
