"""A static eviction's packing plan and block release (ops/pack_blocks.py): kernel == torch
reference, and the reference packs and releases as the eager pager does."""

import pytest
import torch

from kvcompose.ops.pack_blocks import pack_plan, pack_plan_torch, release_blocks


def make_region(B: int, W: int, bs: int, seed: int, live: float = 0.6):
    """Rows owning a random number of distinct blocks (-1 after them), written up to a random
    slot of their last block, random live bits; the pool's last slot is the trash (never live).
    Row 0 owns every column, row 1 nothing; row 2 has one block whose slots all died."""
    g = torch.Generator().manual_seed(seed)
    capacity = 2 * B * W + 1
    ids = torch.randperm(capacity - 1, generator=g)[:B * W].reshape(B, W)
    owned = torch.randint(0, W + 1, (B,), generator=g)
    owned[0], owned[1], owned[2] = W, 0, max(W // 2, 1)
    table = torch.where(torch.arange(W)[None, :] < owned[:, None], ids, -1).contiguous()
    length = ((owned - 1).clamp(min=0) * bs + torch.randint(1, bs + 1, (B,), generator=g)) * (owned > 0)
    valid = torch.rand(capacity * bs, generator=g) < live
    valid[-bs:] = False  # the trash block
    valid[table[2, 0] * bs:(table[2, 0] + 1) * bs] = False
    return table, length, valid, (capacity - 1) * bs, g


def plan(state, backend, bs, max_holes):
    table, length, valid, trash, _ = state
    return pack_plan(table, length, valid, bs, trash, max_holes, backend=backend)


@pytest.mark.parametrize("B,W,bs,max_holes,seed", [(5, 3, 4, 1, 0), (4, 9, 16, 16, 1), (3, 70, 16, 8, 2),
                                                   (6, 2, 8, 0, 3), (4, 5, 4, 1000, 4)])
def test_pack_plan_kernel_matches_reference(B, W, bs, max_holes, seed):
    state = make_region(B, W, bs, seed)
    for a, b, name in zip(plan(state, "torch", bs, max_holes), plan(state, "triton", bs, max_holes),
                          ("phys", "target", "moving")):
        assert torch.equal(a, b), name


def test_the_newest_live_tokens_move_into_the_earliest_holes():
    bs = 4
    table = torch.tensor([[3, 1, -1]])
    length = torch.tensor([7])  # slots 12..15 of block 3, then 4..6 of block 1
    valid = torch.zeros(5 * bs, dtype=torch.bool)
    valid[[12, 14, 5, 6]] = True  # holes at 13 and 15 (and 4, past the live count: left alone)
    phys, target, moving = pack_plan_torch(table, length, valid, bs, trash=16, max_holes=2)
    assert phys[0, :8].tolist() == [12, 13, 14, 15, 4, 5, 6, 7] and (phys[0, 8:] == 16).all()
    assert moving[0].nonzero().flatten().tolist() == [5, 6]  # slots 5 and 6 ...
    assert target[0, 5].item() == 13 and target[0, 6].item() == 15  # ... to the first two holes
    assert not pack_plan_torch(table, length, valid, bs, trash=16, max_holes=4)[2].any()  # too few holes


def released(state, backend, bs, width):
    table, length, valid, _, g = state
    B = table.shape[0]
    count = torch.randint(0, width // 2 + 1, (B,), generator=g)
    ids = torch.where(torch.arange(width + 1)[None, :] < count[:, None], torch.arange(width + 1) + 1000, -1)
    table, length, ids = table.clone(), length.clone(), ids.contiguous()
    num_blocks, overflow = (table >= 0).sum(1), torch.zeros((), dtype=torch.int32)
    release_blocks(table, length, num_blocks, valid, bs, ids, count, overflow, backend=backend)
    return table, length, num_blocks, ids, count, overflow


@pytest.mark.parametrize("B,W,bs,live,width,seed", [(5, 3, 4, 0.6, 8, 0), (4, 9, 16, 0.02, 12, 1),
                                                    (3, 70, 16, 0.01, 200, 2), (6, 4, 4, 0.1, 3, 3)])
def test_release_kernel_matches_reference(B, W, bs, live, width, seed):
    want = released(make_region(B, W, bs, seed, live), "torch", bs, width)
    got = released(make_region(B, W, bs, seed, live), "triton", bs, width)
    for a, b, name in zip(want, got, ("table", "length", "num_blocks", "ids", "count", "overflow")):
        assert torch.equal(a, b), name


def test_released_blocks_go_onto_the_stack_and_the_rest_move_up():
    bs = 2
    table = torch.tensor([[4, 2, 7, -1]])
    length = torch.tensor([5])  # blocks 4 and 2 full, one slot of block 7
    valid = torch.zeros(10 * bs, dtype=torch.bool)
    valid[[8, 14]] = True  # block 4 and block 7 live; block 2 empty
    ids, count = torch.tensor([[9, -1, -1, -1]]), torch.tensor([1])
    num_blocks, overflow = torch.tensor([3]), torch.zeros((), dtype=torch.int32)
    release_blocks(table, length, num_blocks, valid, bs, ids, count, overflow, backend="torch")
    assert table.tolist() == [[4, 7, -1, -1]] and num_blocks.tolist() == [2] and length.tolist() == [3]
    assert ids.tolist() == [[9, 2, -1, -1]] and count.tolist() == [2] and overflow.item() == 0


def test_bad_input_is_named():
    table, length, valid, trash, _ = make_region(3, 4, 4, 0)
    with pytest.raises(ValueError, match="int64"):
        pack_plan(table.int(), length, valid, 4, trash, 1)
    with pytest.raises(ValueError, match=r"lengths \[B\]"):
        pack_plan(table, length[:2], valid, 4, trash, 1)


@pytest.mark.gpu
def test_kernels_match_reference_on_gpu():
    bs = 16
    for W, max_holes, live in ((70, 16, 0.6), (130, 8, 0.05)):
        state = make_region(16, W, bs, W)
        cuda = (*(t.cuda() for t in state[:3]), state[3], state[4])
        for a, b in zip(plan(cuda, "torch", bs, max_holes), plan(cuda, None, bs, max_holes)):
            assert torch.equal(a, b)
        table, length, valid, _, _ = make_region(16, W, bs, W, live)
        count = torch.randint(0, 20, (16,)).cuda()
        ids = torch.where(torch.arange(W + 1)[None, :] < count[:, None].cpu(), torch.arange(W + 1), -1).cuda()
        results = []
        for backend in ("torch", None):
            t, n, i, c = table.clone().cuda(), length.clone().cuda(), ids.clone(), count.clone()
            nb, over = (t >= 0).sum(1), torch.zeros((), dtype=torch.int32, device="cuda")
            release_blocks(t, n, nb, valid.cuda(), bs, i, c, over, backend=backend)
            results.append((t, n, nb, i, c, over))
        for a, b in zip(*results):
            assert torch.equal(a, b)
