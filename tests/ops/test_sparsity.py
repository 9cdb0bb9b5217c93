"""Attention-sparsity op: Triton kernel vs torch reference, GQA semantics, masks, checks."""

import math

import pytest
import torch

from kvcompose.ops.sparsity import BLOCK_L, COMBINE_MODES, attention_sparsity, attention_sparsity_reference


def make_inputs(b, hq, hkv, length, d, seed=0, spread=1.5, live=0.7, dtype=torch.float32, device="cpu"):
    """Random decode queries and keys; logit spread chosen so sparsity lands strictly inside (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * spread).to(dtype)
    k = (torch.randn(b, hkv, length, d, generator=g) * spread).to(dtype)
    valid = torch.rand(b, length, generator=g) < live
    valid[:, 0] = True
    return q.to(device), k.to(device), valid.to(device)


def both(q, k, valid, scaling=None, **kw):
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    tri = attention_sparsity(q, k, valid, scaling, backend="triton", **kw)
    ref = attention_sparsity(q, k, valid, scaling, backend="torch", **kw)
    return tri, ref


@pytest.mark.parametrize("combine", COMBINE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_gqa(combine, dtype):
    length = 2 * BLOCK_L + 37  # not a multiple of the block
    q, k, valid = make_inputs(3, 6, 2, length, 16, dtype=dtype)  # Hq = 3 * Hkv
    tri, ref = both(q, k, valid, combine=combine)
    assert tri.shape == (3,) and tri.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).all(), ref  # a non-trivial signal
    torch.testing.assert_close(tri, ref, atol=1.0 / length, rtol=0)


@pytest.mark.parametrize("length", [1, BLOCK_L - 1, BLOCK_L, BLOCK_L + 1])
def test_block_edges(length):
    q, k, valid = make_inputs(2, 4, 2, length, 8, seed=length)
    for combine in COMBINE_MODES:
        tri, ref = both(q, k, valid, combine=combine)
        torch.testing.assert_close(tri, ref, atol=1.0 / length, rtol=0)


def test_row_alone_equals_row_in_batch():
    length = 150
    q, k, valid = make_inputs(4, 6, 2, length, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    for i, n_live in enumerate([1, 17, 90, 150]):  # different, non-contiguous live sets
        valid[i] = False
        valid[i, torch.randperm(length, generator=g)[:n_live]] = True
        k[i, :, ~valid[i]] = float("nan")  # dead slots may hold garbage
    for combine in COMBINE_MODES:
        for backend in ("triton", "torch"):
            batch = attention_sparsity(q, k, valid, 0.25, backend=backend, combine=combine)
            for i in range(4):
                one = slice(i, i + 1)
                alone = attention_sparsity(q[one], k[one], valid[one], 0.25, backend=backend, combine=combine)
                torch.testing.assert_close(alone[0], batch[i], atol=1.0 / length, rtol=0)
            assert batch[0] == 0  # a single live slot is its own maximum


def test_all_but_one_slot_invalid_and_empty_rows():
    q, k, valid = make_inputs(3, 4, 2, 70, 8, seed=5)
    valid[:] = False
    valid[0, 33] = True  # one live slot
    valid[1, 69] = True  # one live slot, in the last (partial) block
    k[:, :, ~valid.any(0)] = float("inf")  # dead slots are never read into the result
    for combine in COMBINE_MODES:
        tri, ref = both(q, k, valid, combine=combine)
        assert tri.tolist() == [0.0, 0.0, 0.0]  # row 2 has no live slot: 0 by convention
        assert ref.tolist() == [0.0, 0.0, 0.0]


def test_threshold_is_relative_to_the_row_max():
    # One head whose probabilities are exactly p: logits log p (keys e_j * log p_j, query of ones).
    p = torch.tensor([0.5, 0.004, 0.006, 0.49])
    k = torch.diag(p.log())[None, None]  # [1, 1, 4, 4]
    q = torch.ones(1, 1, 4)
    valid = torch.ones(1, 4, dtype=torch.bool)
    for combine in COMBINE_MODES:
        tri, ref = both(q, k, valid, scaling=1.0, combine=combine)
        assert tri.item() == pytest.approx(0.25) and ref.item() == pytest.approx(0.25)  # only 0.004 < 0.01 * 0.5
    tri, ref = both(q, k, valid, scaling=1.0, threshold=0.02)
    assert tri.item() == pytest.approx(0.5) and ref.item() == pytest.approx(0.5)


def test_gqa_pools_probabilities_over_the_query_group():
    # KV head 0 serves 3 query heads. Head 0 is peaked on slot 0, heads 1-2 are flat:
    # max-pooling the *probabilities* keeps the flat heads' 1/L everywhere (nothing is
    # below 1% of the max), whereas pooling logits and applying one softmax would be
    # peaked and report 7/8.
    length, d = 8, 8
    k = torch.eye(length, d)[None, None] * 10.0
    q = torch.zeros(1, 3, d)
    q[0, 0, 0] = 1.0  # logit 10 on slot 0
    valid = torch.ones(1, length, dtype=torch.bool)
    tri, ref = both(q, k, valid, scaling=1.0)
    assert tri.item() == 0.0 and ref.item() == 0.0
    # Three peaked heads on three different slots: the group row has three peaks.
    q = torch.zeros(1, 3, d)
    q[0, 0, 0] = q[0, 1, 1] = q[0, 2, 2] = 2.0
    tri, ref = both(q, k, valid, scaling=1.0)
    assert tri.item() == pytest.approx(5 / 8) and ref.item() == pytest.approx(5 / 8)


def test_combine_modes_differ_when_groups_disagree():
    # Two KV heads (MHA, one query head each); head 0 looks at slot 0, head 1 at slot 3.
    length, d = 4, 4
    k = torch.eye(length, d)[None].repeat(2, 1, 1)[None] * 30.0  # [1, 2, 4, 4]
    q = torch.zeros(1, 2, d)
    q[0, 0, 0] = q[0, 1, 3] = 1.0
    valid = torch.ones(1, length, dtype=torch.bool)
    # per-group sparsity 3/4 each; the averaged row [.5, 0, 0, .5] has 2 of 4 below 1%
    tri, ref = both(q, k, valid, scaling=1.0, combine="sparsity")
    assert tri.item() == pytest.approx(0.75) and ref.item() == pytest.approx(0.75)
    tri, ref = both(q, k, valid, scaling=1.0, combine="scores")
    assert tri.item() == pytest.approx(0.5) and ref.item() == pytest.approx(0.5)


def test_strided_keys_and_mixed_dtypes():
    q, k, valid = make_inputs(2, 4, 2, 90, 16, seed=7)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # the store's [B, L, H, D] layout
    assert not k_strided.is_contiguous()
    tri, ref = both(q, k_strided, valid)
    torch.testing.assert_close(tri, ref, atol=1 / 90, rtol=0)
    tri, ref = both(q, k.to(torch.bfloat16), valid)  # fp32 queries, bf16 keys
    torch.testing.assert_close(tri, ref, atol=1 / 90, rtol=0)


def test_group_size_argument_and_reference_signature():
    q, k, valid = make_inputs(2, 4, 2, 40, 8, seed=8)
    a = attention_sparsity(q, k, valid, 0.3, group_size=2, backend="triton")
    b = attention_sparsity_reference(q, k, valid, 0.3, group_size=2)
    torch.testing.assert_close(a, b, atol=1 / 40, rtol=0)
    with pytest.raises(ValueError, match="group_size=3"):
        attention_sparsity(q, k, valid, 0.3, group_size=3)


class Recorded:
    """One rank of two: what its mean over heads receives is kept (``seen``), and with the other
    rank's (``other``) the mean covers the heads of both."""

    sharded = True

    def __init__(self, other=None):
        self.other, self.seen = other, []

    def mean(self, x, dim=1):
        self.seen.append(x)
        return x.mean(dim) if self.other is None else torch.cat([x, self.other.seen.pop(0)], dim).mean(dim)


@pytest.mark.parametrize("combine", COMBINE_MODES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_two_ranks_combine_the_heads_of_both(combine, backend, device="cpu"):
    """Each rank holds two of the four KV heads: with the all-reduced mean over heads, the
    fraction equals one process's over all four (the kernels pool, the ranks combine)."""
    q, k, valid = make_inputs(3, 8, 4, BLOCK_L + 21, 16, seed=5, device=device)
    scaling = 16 ** -0.5
    whole = attention_sparsity(q, k, valid, scaling, backend="torch", combine=combine)
    second = Recorded()
    attention_sparsity(q[:, 4:], k[:, 2:], valid, scaling, backend=backend, combine=combine, heads=second)
    first = Recorded(other=second)
    got = attention_sparsity(q[:, :4], k[:, :2], valid, scaling, backend=backend, combine=combine, heads=first)
    assert len(first.seen) == 1  # one reduction
    torch.testing.assert_close(got, whole, atol=1.0 / valid.shape[1], rtol=0)
    alone = attention_sparsity(q[:, :4], k[:, :2], valid, scaling, backend=backend, combine=combine)
    assert not torch.allclose(alone, whole)  # half of the heads alone measure otherwise


@pytest.mark.gpu
@pytest.mark.parametrize("combine", COMBINE_MODES)
def test_gpu_two_ranks_combine_the_heads_of_both(combine):
    test_two_ranks_combine_the_heads_of_both(combine, "triton", device="cuda")


def test_nonfinite_inputs_name_the_tensor():
    q, k, valid = make_inputs(2, 4, 2, 20, 8)
    bad_q = q.clone()
    bad_q[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="query"):
        attention_sparsity(bad_q, k, valid, 0.3)
    bad_k = k.clone()
    bad_k[0, 1, 0, 0] = float("inf")  # slot 0 is live
    with pytest.raises(ValueError, match="keys"):
        attention_sparsity(q, bad_k, valid, 0.3)
    valid[1, 5] = False
    ok_k = k.clone()
    ok_k[1, :, 5] = float("nan")  # a dead slot: allowed
    assert torch.isfinite(attention_sparsity(q, ok_k, valid, 0.3)).all()


def test_shape_and_argument_errors_name_the_shapes():
    q, k, valid = make_inputs(2, 4, 2, 20, 8)
    with pytest.raises(ValueError, match=r"\(2, 4, 8\).*\(2, 2, 20, 6\)"):
        attention_sparsity(q, k[..., :6], valid, 0.3)
    with pytest.raises(ValueError, match=r"multiple of KV heads"):
        attention_sparsity(q[:, :3], k, valid, 0.3)
    with pytest.raises(ValueError, match=r"\(2, 20\).*\(2, 19\)"):
        attention_sparsity(q, k, valid[:, :19], 0.3)
    with pytest.raises(ValueError, match=r"\[B, Hq, D\]"):
        attention_sparsity(q[0], k, valid, 0.3)
    with pytest.raises(ValueError, match="bool"):
        attention_sparsity(q, k, valid.int(), 0.3)
    with pytest.raises(ValueError, match="combine"):
        attention_sparsity(q, k, valid, 0.3, combine="mean")
    with pytest.raises(ValueError, match="backend"):
        attention_sparsity(q, k, valid, 0.3, backend="cuda")
    with pytest.raises(ValueError, match="scaling"):
        attention_sparsity(q, k, valid, math.nan)


@pytest.mark.gpu
@pytest.mark.parametrize("combine", COMBINE_MODES)
def test_gpu_kernel_matches_reference_llama_shape(combine):
    length = 4096
    q, k, valid = make_inputs(16, 32, 8, length, 128, seed=11, spread=2.0, live=0.8,
                              dtype=torch.bfloat16, device="cuda")
    tri, ref = both(q, k, valid, combine=combine)
    assert ((ref > 0) & (ref < 1)).all()
    torch.testing.assert_close(tri, ref, atol=4.0 / length, rtol=0)
