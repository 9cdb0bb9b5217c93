"""R-KV's redundancy column sums (kvcompose.ops.redundancy): kernel == torch reference == the rkv evictor's old code.

The CPU runs use the Triton interpreter (``backend="triton"``); the gpu test compares the
compiled kernel with the reference at Llama-3-8B head shapes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvcompose.evictors import EvictionContext, RKVEvictor
from kvcompose.evictors import rkv as rkv_module
from kvcompose.evictors.attention import reduce_heads
from kvcompose.ops import redundancy as op
from kvcompose.ops.redundancy import _kernel_outputs, redundancy_column_sums, redundancy_column_sums_torch

EPS = 1e-8


def old_head_redundancy(keys, valid, positions, threshold, beta) -> torch.Tensor:
    """``RKVEvictor.head_redundancy`` as it was before the op: the dense reference's column
    sums (the evictor's old code, moved into the op module), then the mean and softmax."""
    return redundancy_from_sums(redundancy_column_sums_torch(keys, valid, positions, threshold, beta), valid)


def redundancy_from_sums(sums, valid) -> torch.Tensor:
    """The evictor's last steps: mean over the live count, softmax over live columns."""
    mean_sim = sums / valid.sum(dim=1).clamp(min=1).to(sums.dtype)[:, None, None]
    valid_h = valid[:, None, :].expand_as(mean_sim)
    return torch.where(valid_h, mean_sim.masked_fill(~valid_h, float("-inf")).softmax(dim=-1), 0.0)


def make_inputs(seed, B, H, L, D, dtype=torch.float32, p_valid=0.75, copies=True, garbage=True):
    """Keys with exact copies (ties in similarity), near copies and negated copies; unique positions
    with gaps in shuffled slots; rows 1-3 (when present) hold 0, 1 and 2 valid tokens (the two
    copies of one key); empty slots hold NaN or large junk keys."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, L, D, generator=g)
    if copies and L >= 8:
        n = max(2, L // 6)
        src = torch.randint(0, L, (n,), generator=g)
        dst = torch.randint(0, L, (n,), generator=g)
        keys[:, :, dst] = keys[:, :, src]  # exact copies
        near = torch.randint(0, L, (n,), generator=g)
        keys[:, :, near] = keys[:, :, src] + 0.1 * torch.randn(B, H, n, D, generator=g)
        neg = torch.randint(0, L, (max(1, n // 2),), generator=g)
        keys[:, :, neg] = -keys[:, :, src[: neg.numel()]]
    valid = torch.rand(B, L, generator=g) < p_valid
    for row, count in ((1, 0), (2, 1), (3, 2)):
        if row < B and L >= count:
            valid[row] = False
            slots = torch.randperm(L, generator=g)[:count]
            valid[row, slots] = True
            if count == 2:
                keys[row, :, slots[1]] = keys[row, :, slots[0]]
    positions = torch.full((B, L), -1, dtype=torch.long)
    for b in range(B):
        n = int(valid[b].sum())
        positions[b, valid[b]] = torch.randperm(3 * L + 3, generator=g)[:n]
    if garbage:
        dead = ~valid[:, None, :, None].expand_as(keys)
        junk = torch.where(torch.rand(keys.shape, generator=g) < 0.5, float("nan"), 1e6)
        keys = torch.where(dead, junk, keys)
    return keys.to(dtype), valid, positions


def assert_threshold_is_clear(keys, valid, threshold, gap=1e-5):
    """No valid pair lies within ``gap`` of the threshold (else fp32 rounding may legitimately decide it
    either way): the data's precondition, checked so that a seed change cannot make a test flaky."""
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + EPS)
    sim = unit @ unit.transpose(-1, -2)
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    assert not bool(((sim - threshold).abs() < gap)[pair.expand_as(sim)].any()), "the data has a pair at the threshold"


CASES = [
    # (seed, B, H, L, D, dtype, beta, threshold, (rows per program, columns per tile))
    (0, 5, 2, 70, 24, torch.float32, 1, 0.5, (128, 64)),
    (1, 5, 2, 70, 24, torch.bfloat16, 1, 0.5, (64, 64)),
    (2, 4, 2, 67, 8, torch.float16, 1, 0.3, (32, 16)),
    (3, 5, 1, 70, 32, torch.float32, 0, 0.5, (16, 16)),
    (4, 4, 2, 45, 24, torch.float32, 1, 0.999, (16, 16)),
    (5, 4, 2, 45, 24, torch.bfloat16, 1, -0.999, (32, 16)),
    (6, 4, 1, 61, 16, torch.float32, 2, 0.5, (16, 16)),
    (7, 4, 1, 70, 24, torch.bfloat16, 0, -0.2, (32, 16)),
    (8, 2, 1, 5, 24, torch.float32, 1, 0.0, (16, 16)),
    (9, 4, 1, 1, 8, torch.float32, 1, 0.5, (16, 16)),
    (10, 5, 2, 64, 64, torch.bfloat16, 1, 0.999, (128, 64)),
]


def set_tiles(monkeypatch, rows, cols):
    monkeypatch.setattr(op, "BLOCK_ROWS", rows)
    monkeypatch.setattr(op, "BLOCK_COLS", cols)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[0]}-L{c[3]}-D{c[4]}-{str(c[5])[6:]}-b{c[6]}-t{c[7]}-"
                                                      f"T{c[8][0]}x{c[8][1]}")
def test_kernel_matches_reference_and_old_code(case, monkeypatch):
    seed, B, H, L, D, dtype, beta, threshold, tiles = case
    set_tiles(monkeypatch, *tiles)  # small tiles: many of them at small L, the diagonal ones in the middle
    keys, valid, positions = make_inputs(seed, B, H, L, D, dtype)
    assert_threshold_is_clear(keys, valid, threshold)
    got = redundancy_column_sums(keys, valid, positions, threshold, beta, backend="triton")
    want = redundancy_column_sums_torch(keys, valid, positions, threshold, beta)
    assert got.dtype == torch.float32 and got.shape == (B, H, L)
    assert bool((got[~valid[:, None, :].expand_as(got)] == 0).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    old = old_head_redundancy(keys, valid, positions, threshold, beta)
    torch.testing.assert_close(redundancy_from_sums(got, valid), old, rtol=1e-5, atol=1e-7)
    assert torch.equal(redundancy_from_sums(want, valid), old)  # the reference is the old code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_spares_the_references_partner(dtype, monkeypatch):
    set_tiles(monkeypatch, 32, 16)
    keys, valid, positions = make_inputs(11, 5, 2, 45, 16, dtype)
    threshold = 0.4
    assert_threshold_is_clear(keys, valid, threshold)
    row_sum, col, sim = _kernel_outputs(keys, valid, positions, threshold, 1)
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + EPS)
    dense = unit @ unit.transpose(-1, -2)
    L = dense.shape[-1]
    pair = valid[:, None, :, None] & valid[:, None, None, :] & ~torch.eye(L, dtype=torch.bool)
    dense = dense.masked_fill(~pair, 0.0)
    torch.testing.assert_close(row_sum, dense.sum(-1), rtol=1e-5, atol=1e-5)
    similar_pos = torch.where(pair & (dense > threshold), positions[:, None, None, :].float(), -1.0)
    best = similar_pos.max(-1)
    expected_col = torch.where(best.values >= 0, best.indices, -1)
    assert torch.equal(col, expected_col)
    expected_sim = torch.where(expected_col >= 0, dense.gather(-1, expected_col.clamp(min=0)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(sim, expected_sim, rtol=1e-6, atol=1e-6)
    assert bool((expected_col >= 0).any()) and bool((expected_col < 0).any())  # both kinds of rows occur


def test_strided_keys_and_negative_positions():
    keys, valid, positions = make_inputs(12, 3, 2, 40, 16, garbage=False)
    strided = keys.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, L, D] view of [B, L, H, D] memory
    assert not strided.is_contiguous()
    positions = torch.where(valid & (torch.arange(40) % 7 == 0), -5, positions)  # never spared, still counted
    got = redundancy_column_sums(strided, valid, positions, 0.5, 1, backend="triton")
    want = redundancy_column_sums_torch(keys, valid, positions, 0.5, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 0, 5, 8), (2, 2, 0, 8)])
def test_empty_shapes(shape):
    B, H, L, D = shape
    keys = torch.randn(shape)
    valid = torch.ones(B, L, dtype=torch.bool)
    positions = torch.arange(L).expand(B, L)
    for backend in ("triton", "torch"):
        out = redundancy_column_sums(keys, valid, positions, 0.5, 1, backend=backend)
        assert out.shape == (B, H, L) and out.dtype == torch.float32 and bool((out == 0).all())


def test_beta_above_one_runs_the_reference():
    keys, valid, positions = make_inputs(13, 3, 2, 30, 8)
    for beta in (2, 3, 100):
        got = redundancy_column_sums(keys, valid, positions, 0.2, beta, backend="triton")
        assert torch.equal(got, redundancy_column_sums_torch(keys, valid, positions, 0.2, beta))


def test_default_backend_on_cpu_is_the_reference():
    keys, valid, positions = make_inputs(14, 3, 2, 30, 8)
    assert torch.equal(redundancy_column_sums(keys, valid, positions, 0.5, 1),
                       redundancy_column_sums_torch(keys, valid, positions, 0.5, 1))


def test_bad_input_is_named():
    keys, valid, positions = make_inputs(15, 2, 2, 6, 8)
    call = functools.partial(redundancy_column_sums, keys, valid, positions, 0.5, 1)
    with pytest.raises(ValueError, match=r"keys must be a tensor \[B, Hkv, L, D\], got \(2, 6, 8\)"):
        redundancy_column_sums(keys[:, 0], valid, positions, 0.5, 1)
    with pytest.raises(ValueError, match=r"dtype torch.int64; accepted: torch.float16"):
        redundancy_column_sums(keys.long(), valid, positions, 0.5, 1)
    with pytest.raises(ValueError, match=r"valid must be \[B, L\] = \[2, 6\].*got \(2, 5\)"):
        redundancy_column_sums(keys, valid[:, :5], positions, 0.5, 1)
    with pytest.raises(ValueError, match=r"valid must be torch.bool, got torch.uint8"):
        redundancy_column_sums(keys, valid.to(torch.uint8), positions, 0.5, 1)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor, got torch.float32"):
        redundancy_column_sums(keys, valid, positions.float(), 0.5, 1)
    with pytest.raises(ValueError, match=r"threshold must be a real number.*got nan"):
        redundancy_column_sums(keys, valid, positions, float("nan"), 1)
    with pytest.raises(ValueError, match=r"threshold must be a real number.*got tensor"):
        redundancy_column_sums(keys, valid, positions, torch.tensor(0.5), 1)
    for beta in (-1, True, 1.0):
        with pytest.raises(ValueError, match=r"beta \(spared partners per token\) must be an int >= 0, got"):
            redundancy_column_sums(keys, valid, positions, 0.5, beta)
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'"):
        call(backend="cuda")
    with pytest.raises(ValueError, match=r"the kernel reads float16/bfloat16/float32 keys, got torch.float64"):
        redundancy_column_sums(keys.double(), valid, positions, 0.5, 1, backend="triton")
    assert redundancy_column_sums(keys.double(), valid, positions, 0.5, 1).dtype == torch.float32


# ------------------------------------------------------------------ the evictor
def make_ctx(seed, dtype=torch.float32):
    keys, valid, positions = make_inputs(seed, 4, 2, 40, 16, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    B, H, L, D = keys.shape
    W = 8
    last = positions.max(1).values
    query_positions = last[:, None] - torch.arange(W - 1, -1, -1)[None, :]
    return EvictionContext(
        keys=keys, positions=positions, valid=valid, keep=valid.sum(1) // 2,
        protected=torch.zeros(B, L, dtype=torch.bool), queries=torch.randn(B, 2 * H, W, D, generator=g).to(dtype),
        query_valid=(query_positions >= 0) & valid.any(1, keepdim=True), query_positions=query_positions,
        scaling=D**-0.5,
    )


def old_scores(ev: RKVEvictor, ctx: EvictionContext) -> torch.Tensor:
    red = old_head_redundancy(ctx.keys, ctx.valid, ctx.positions, ev.threshold, ev.keep_recent_similar)
    return reduce_heads(ev.lam * ev.head_importance(ctx) - (1.0 - ev.lam) * red, ev.head_reduce)


@pytest.mark.parametrize("config, dtype", [
    (dict(), torch.float32),
    (dict(lam=0.0, threshold=0.999), torch.bfloat16),
    (dict(lam=0.3, keep_recent_similar=0), torch.bfloat16),
    (dict(lam=0.0, threshold=-0.3, keep_recent_similar=2), torch.float32),
])
def test_rkv_evictor_scores_unchanged(config, dtype, monkeypatch):
    ev = RKVEvictor(**config)
    ctx = make_ctx(16, dtype)
    assert_threshold_is_clear(ctx.keys, ctx.valid, ev.threshold)
    old = old_scores(ev, ctx)
    assert torch.equal(ev.scores(ctx), old)  # CPU: the reference, the same code as before
    old_keep = ev.select(ctx)
    kernel = functools.partial(redundancy_column_sums, backend="triton")
    monkeypatch.setattr(rkv_module, "redundancy_column_sums", kernel)
    torch.testing.assert_close(ev.scores(ctx), old, rtol=1e-5, atol=1e-7)
    assert torch.equal(ev.select(ctx), old_keep)


# ---------------------------------------------------------------------- GPU
def clustered_keys(B, H, L, D, dtype, device, seed=0):
    """Keys around L // 4 random directions (within-cluster cosine about 0.8, across about 0 ± 0.09), so
    that a threshold of 0.5 has many similar pairs and none near it."""
    g = torch.Generator(device=device).manual_seed(seed)
    centers = torch.randn(B, H, L // 4, D, generator=g, device=device)
    which = torch.randint(0, L // 4, (L,), generator=g, device=device)
    keys = centers[:, :, which] + 0.5 * torch.randn(B, H, L, D, generator=g, device=device)
    return keys.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_reference(dtype):
    B, H, L, D = 2, 8, 1100, 128
    keys = clustered_keys(B, H, L, D, dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    valid = torch.rand(B, L, generator=g, device="cuda") < 0.9
    positions = torch.stack([torch.randperm(2 * L, generator=g, device="cuda")[:L] for _ in range(B)])
    positions = torch.where(valid, positions, -1)
    assert_threshold_is_clear(keys, valid, 0.5, gap=1e-4)
    for beta in (0, 1):
        got = redundancy_column_sums(keys, valid, positions, 0.5, beta)  # backend None: the kernel on CUDA
        want = redundancy_column_sums_torch(keys, valid, positions, 0.5, beta)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        old = old_head_redundancy(keys, valid, positions, 0.5, beta)
        torch.testing.assert_close(redundancy_from_sums(got, valid), old, rtol=1e-4, atol=1e-7)


@pytest.mark.gpu
def test_cuda_kernel_is_captured_in_a_graph():
    B, H, L, D = 2, 2, 300, 128
    keys = clustered_keys(B, H, L, D, torch.bfloat16, "cuda", seed=2)
    valid = torch.rand(B, L, device="cuda") < 0.9
    positions = torch.where(valid, torch.arange(L, device="cuda").flip(0).expand(B, L), -1)
    redundancy_column_sums(keys, valid, positions, 0.5, 1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = redundancy_column_sums(keys, valid, positions, 0.5, 1)
    keys.copy_(clustered_keys(B, H, L, D, torch.bfloat16, "cuda", seed=3))
    graph.replay()
    torch.testing.assert_close(out, redundancy_column_sums(keys, valid, positions, 0.5, 1), rtol=1e-4, atol=1e-4)
