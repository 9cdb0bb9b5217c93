"""TBE's per-segment bookkeeping: sizes and classes against their definition (a [B, L, S]
membership), the step-down levels, and the plan as one compiled graph giving the eager results."""

import pytest
import torch

from kvcompose import compiled
from kvcompose.evictors.tbe import ThoughtEvictor, kept_tokens, plan_segments, segment_sizes_and_classes


def test_segment_sizes_and_classes_match_the_membership_definition():
    g = torch.Generator().manual_seed(0)
    B, L, S = 4, 50, 6
    seg = torch.randint(-1, S + 2, (B, L), generator=g)  # -1: prompt; S and above: beyond the segments held
    gen = (seg >= 0) & (torch.rand(B, L, generator=g) < 0.8)
    classes = torch.randint(0, 3, (B, L), generator=g)
    seg[3] = -1  # a row without generated tokens
    gen[3] = False
    size, cls = segment_sizes_and_classes(seg, gen, classes, S)
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


def _plan_inputs(device="cpu", seed=0):
    """A batch of rows with random live slots, positions and classes, for :func:`plan_segments`."""
    g = torch.Generator().manual_seed(seed)
    B, L, prompt, tau = 3, 200, 20, 16
    valid = torch.rand(B, L, generator=g) < 0.8
    positions = torch.where(valid, torch.stack([torch.randperm(L, generator=g) for _ in range(B)]), -1)
    classes = torch.randint(0, 3, (B, L), generator=g)
    keep = torch.tensor([60, 80, 100])
    padded, offsets = ThoughtEvictor(retention=(8, 4, 2))._tables(torch.device("cpu"))
    by_class = torch.tensor([5, 4, 3, 2])  # as select() builds it for classes (R, E, T), an empty segment first
    tensors = [t.to(device) for t in (valid, positions, classes, keep, padded, offsets, by_class)]
    return (*tensors, prompt, tau, (L - prompt) // tau, 2)


def test_the_segment_plan_and_the_kept_tokens_trace_as_whole_graphs():
    """A fused decode compiles both functions whole (``fullgraph``: a graph break would be an
    error there); traced, they give the eager results, and some segment shrinks in this batch."""
    args = _plan_inputs()
    eager = plan_segments.eager(*args)
    traced = torch.compile(plan_segments.eager, backend="aot_eager", fullgraph=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced))
    cols, live, goal, shrinks, rows = eager
    assert bool(shrinks.any()) and bool((goal[shrinks] > 0).all()) and bool((goal[~shrinks] == 0).all())
    chosen = torch.rand(live.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    keep_args = (args[0], torch.zeros_like(args[0]), cols, live, chosen, shrinks)
    traced_keep = torch.compile(kept_tokens.eager, backend="aot_eager", fullgraph=True)(*keep_args)
    assert torch.equal(kept_tokens.eager(*keep_args), traced_keep)


def test_fused_functions_run_as_written_on_cpu_and_outside_the_block(monkeypatch):
    """Only CUDA tensors inside compiled_functions() reach torch.compile."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled on CPU or outside a fused decode")

    monkeypatch.setattr(torch, "compile", refuse)
    args = _plan_inputs()
    with compiled.compiled_functions():
        assert compiled.compiling()
        inside = plan_segments(*args)
    assert not compiled.compiling()
    assert all(torch.equal(a, b) for a, b in zip(inside, plan_segments(*args)))


@pytest.mark.gpu
def test_the_compiled_plan_gives_the_eager_plan_on_cuda():
    """Inductor's kernels for the plan and the kept tokens give the eager results (integer work)."""
    for seed in range(3):
        args = _plan_inputs("cuda", seed)
        with compiled.compiled_functions():
            fast = plan_segments(*args)
        assert all(torch.equal(a, b) for a, b in zip(plan_segments.eager(*args), fast))
        cols, live, goal, shrinks, rows = fast
        chosen = torch.rand(live.shape, device="cuda") < 0.5
        keep_args = (args[0], args[0] & (args[1] < 30), cols, live, chosen, shrinks)
        with compiled.compiled_functions():
            assert torch.equal(kept_tokens(*keep_args), kept_tokens.eager(*keep_args))
