"""Batched K-means selection op: Triton kernel vs torch reference, cluster coverage, counts, checks."""

import pytest
import torch

from kvcompose.ops.kmeans import kmeans_select, kmeans_select_reference

BACKENDS = ("triton", "torch")


def random_segments(s, n, f, seed=0, live=0.75, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(s, n, f, generator=g).to(dtype)
    valid = torch.rand(s, n, generator=g) < live
    return keys.to(device), valid.to(device), g


def check_counts(keep, valid, k):
    """Exactly min(k, live) tokens kept, all of them live."""
    k = torch.as_tensor(k).expand(valid.shape[0])
    assert torch.equal(keep.sum(1), torch.minimum(k, valid.sum(1)).to(keep.device)), (keep.sum(1), k, valid.sum(1))
    assert not (keep & ~valid).any()


@pytest.mark.parametrize("dtype,max_k", [(torch.float32, 20), (torch.bfloat16, None)])
def test_kernel_matches_reference(dtype, max_k):
    # N and F are not powers of two or multiples of the feature block; one segment has no
    # live token, one has k = 0, one has k > live; dead slots hold NaN.
    keys, valid, g = random_segments(7, 37, 45, seed=1, dtype=dtype)
    valid[5] = False
    valid[6, 12:] = False
    keys[~valid] = float("nan")
    k = torch.tensor([1, 4, 0, 9, 20, 3, 20])
    tri = kmeans_select(keys, valid, k, iters=4, backend="triton", max_k=max_k)
    ref = kmeans_select(keys, valid, k, iters=4, backend="torch", max_k=max_k)
    assert tri.dtype == torch.bool and tri.shape == valid.shape
    assert torch.equal(tri, ref)
    check_counts(tri, valid, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_separated_clusters_keep_one_token_each(backend):
    s, n, f = 4, 48, 24
    g = torch.Generator().manual_seed(2)
    n_clusters = torch.tensor([2, 3, 5, 8])
    keys = torch.empty(s, n, f)
    label = torch.empty(s, n, dtype=torch.long)
    for i, c in enumerate(n_clusters.tolist()):
        centers = torch.randn(c, f, generator=g) * 20.0
        label[i] = torch.randint(0, c, (n,), generator=g)
        label[i, torch.randperm(n - 5, generator=g)[:c]] = torch.arange(c)  # every cluster among live slots
        keys[i] = centers[label[i]] + 0.1 * torch.randn(n, f, generator=g)
    valid = torch.ones(s, n, dtype=torch.bool)
    valid[:, -5:] = False  # a few dead slots, never chosen
    for i, c in enumerate(n_clusters.tolist()):  # keep every cluster represented among live tokens
        label[i, -5:] = -1
        present = set(label[i, :-5].tolist())
        assert present == set(range(c))
    keep = kmeans_select(keys, valid, n_clusters, iters=3, backend=backend)
    check_counts(keep, valid, n_clusters)
    for i, c in enumerate(n_clusters.tolist()):
        assert sorted(label[i][keep[i]].tolist()) == list(range(c))


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_at_least_live_keeps_every_live_token(backend):
    keys, valid, _ = random_segments(3, 20, 16, seed=3, live=0.5)
    live = valid.sum(1)
    keep = kmeans_select(keys, valid, live + torch.tensor([0, 1, 7]), iters=2, backend=backend)
    assert torch.equal(keep, valid)


def test_counts_and_liveness_over_many_segments():
    # The reference, vectorized over segments, on many shapes of the problem.
    keys, valid, g = random_segments(64, 50, 12, seed=4, live=0.6)
    valid[torch.randint(0, 64, (8,), generator=g)] = False
    k = torch.randint(0, 60, (64,), generator=g)
    keep = kmeans_select(keys, valid, k, iters=5, backend="torch")
    check_counts(keep, valid, k)
    keep = kmeans_select(keys, valid, 6, iters=0, backend="torch")  # a Python int k
    check_counts(keep, valid, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_nearest_token_falls_back_to_next_nearest(backend):
    # Duplicate tokens: seeds x0 (0,0), x2 (10,0), then x1 (a copy of x0). Centroids 0 and 2
    # coincide; centroid 0 keeps x0, so centroid 2 keeps its next-nearest unkept token, x1.
    keys = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [10.0, 0.0], [10.0, 0.0]]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    keep = kmeans_select(keys, valid, 3, iters=2, backend=backend)
    assert keep[0].tolist() == [True, True, True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_equidistant_tokens_go_to_the_earlier_position(backend):
    # The centroid of {(-1,0), (1,0)} is the origin, equally far from both: the earlier wins.
    far, left, right = [10.0, 0.0], [-1.0, 0.0], [1.0, 0.0]
    valid = torch.ones(2, 3, dtype=torch.bool)
    keys = torch.tensor([[far, left, right], [far, right, left]])
    keep = kmeans_select(keys, valid, 2, iters=3, backend=backend)
    assert keep.tolist() == [[True, True, False], [True, True, False]]


def test_segment_alone_equals_segment_in_batch_and_runs_are_deterministic():
    keys, valid, _ = random_segments(5, 30, 20, seed=5)
    k = torch.tensor([3, 7, 1, 12, 5])
    for backend in BACKENDS:
        batch = kmeans_select(keys, valid, k, iters=3, backend=backend, max_k=16)
        assert torch.equal(batch, kmeans_select(keys, valid, k, iters=3, backend=backend, max_k=16))
        for i in (0, 3):
            alone = kmeans_select(keys[i:i + 1], valid[i:i + 1], k[i:i + 1], iters=3, backend=backend, max_k=16)
            assert torch.equal(alone[0], batch[i])


def layer_slots(b, h, l, d, s, n, seed=0, dtype=torch.float32, device="cpu"):
    """A layer's keys [B, H, L, D] and S segments of N slots each, scattered over its rows."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, l, d, generator=g).to(dtype).to(device)
    rows = torch.randint(0, b, (s,), generator=g)
    cols = torch.stack([torch.randperm(l, generator=g)[:n] for _ in range(s)])
    valid = torch.rand(s, n, generator=g) < 0.8
    return keys, (rows.to(device), cols.to(device)), valid.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_read_in_place_equal_the_gathered_segments(backend):
    keys, slots, valid = layer_slots(3, 2, 40, 12, s=6, n=19, seed=9)
    rows, cols = slots
    gathered = keys.permute(0, 2, 1, 3)[rows[:, None], cols].reshape(6, 19, 24)
    k = torch.tensor([3, 0, 5, 1, 0, 8])
    keep = kmeans_select(keys, valid, k, iters=3, backend=backend, max_k=8, slots=slots)
    assert torch.equal(keep, kmeans_select(gathered, valid, k, iters=3, backend=backend, max_k=8))
    assert not keep[k == 0].any()  # k = 0: nothing chosen (the kernel skips the segment)
    check_counts(keep, valid, k)
    with pytest.raises(ValueError, match="slots must be long tensors"):
        kmeans_select(keys, valid, k, slots=(rows, cols[:, :5]))
    with pytest.raises(ValueError, match=r"\[B, Hkv, L, D\]"):
        kmeans_select(gathered, valid, k, slots=slots)


class OtherRank:
    """Tensor parallelism as one rank sees it: its sums over heads gain the other rank's part."""

    sharded = True

    def __init__(self, other):
        self.other = other

    def all_sum(self, x):
        return x + self.other


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_clusters_on_the_gram_of_every_ranks_heads(backend, device="cpu"):
    """Under tensor parallelism each rank holds half of the heads; with the other half's Gram
    added by the all-reduce, both paths keep the tokens one process keeps with every head (the
    kernel reads the summed Gram instead of forming its own)."""
    keys, valid, _ = random_segments(5, 29, 48, seed=4, device=device)
    valid[4] = False
    k = torch.tensor([3, 7, 0, 12, 2], device=device)
    mine, theirs = keys[..., :24], torch.where(valid[..., None], keys[..., 24:], 0.0)
    whole = kmeans_select(keys, valid, k, iters=4, backend=backend, max_k=12)
    half = kmeans_select(mine, valid, k, iters=4, backend=backend, max_k=12,
                         heads=OtherRank(theirs @ theirs.transpose(1, 2)))
    assert torch.equal(half, whole)
    check_counts(half, valid, k)
    alone = kmeans_select(mine, valid, k, iters=4, backend=backend, max_k=12)
    assert not torch.equal(alone, whole)  # half of the heads alone choose otherwise


@pytest.mark.gpu
def test_gpu_rank_clusters_on_the_gram_of_every_ranks_heads():
    test_a_rank_clusters_on_the_gram_of_every_ranks_heads("triton", device="cuda")


def test_reference_entry_point_and_zero_iterations_keep_the_first_live_token():
    keys, valid, _ = random_segments(6, 25, 10, seed=6)
    keep = kmeans_select_reference(keys, valid, 1, iters=0)
    first_live = valid.int().argmax(1)
    assert torch.equal(keep.nonzero()[:, 1], first_live)


def test_checks():
    keys, valid, _ = random_segments(3, 10, 4, seed=7)
    valid[:, 0] = True
    bad = keys.clone()
    bad[1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match="keys"):
        kmeans_select(bad, valid, 2)
    with pytest.raises(ValueError, match=r"\(3, 10\).*\(3, 9\)"):
        kmeans_select(keys, valid[:, :9], 2)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        kmeans_select(keys, valid, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\[S, N, F\]"):
        kmeans_select(keys[0], valid, 2)
    with pytest.raises(ValueError, match=">= 0"):
        kmeans_select(keys, valid, torch.tensor([1, -1, 2]))
    with pytest.raises(ValueError, match="max_k"):
        kmeans_select(keys, valid, torch.tensor([1, 9, 2]), max_k=4)
    with pytest.raises(ValueError, match="iters"):
        kmeans_select(keys, valid, 2, iters=-1)
    with pytest.raises(ValueError, match="backend"):
        kmeans_select(keys, valid, 2, backend="cuda")
    with pytest.raises(ValueError, match="at most 256"):
        kmeans_select(torch.zeros(1, 257, 4), torch.ones(1, 257, dtype=torch.bool), 2, backend="triton")


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_thinkv_shape():
    # 256 segments of 128 tokens, keys of 8 KV heads x 128 dims, TBE's retention levels.
    keys, valid, g = random_segments(256, 128, 8 * 128, seed=8, live=0.9, dtype=torch.bfloat16, device="cuda")
    k = torch.tensor([64, 32, 16, 8, 4], device="cuda").repeat(52)[:256]
    tri = kmeans_select(keys, valid, k, backend="triton", max_k=64)
    ref = kmeans_select(keys, valid, k, backend="torch", max_k=64)
    check_counts(tri, valid, k)
    same = (tri == ref).all(dim=1)
    assert same.all(), f"{int((~same).sum())} of 256 segments differ"


@pytest.mark.gpu
def test_gpu_kernel_reads_slots_in_place_like_a_gathered_copy():
    # TBE's call at scenario b's shapes: 16 rows x 64 segments of one layer's 8 x 128 keys. The
    # kernel must choose exactly what it chooses from a gathered copy (its agreement with the
    # reference, up to fp32 ties, is the test above).
    keys, slots, valid = layer_slots(16, 8, 1400, 128, s=1024, n=128, seed=10, dtype=torch.bfloat16, device="cuda")
    rows, cols = slots
    gathered = keys.permute(0, 2, 1, 3)[rows[:, None], cols].reshape(1024, 128, 8 * 128)
    k = torch.tensor([0, 64, 0, 32, 16, 0, 8, 4], device="cuda").repeat(128)
    tri = kmeans_select(keys, valid, k, backend="triton", max_k=64, slots=slots)
    assert torch.equal(tri, kmeans_select(gathered, valid, k, backend="triton", max_k=64))
    check_counts(tri, valid, k)
