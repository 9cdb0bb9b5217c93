"""Where a static flush writes a region's tokens (ops/claim_slots.py): kernel == torch reference,
and the reference fills holes first, in block order, then appends."""

import pytest
import torch

from kvcompose.ops.claim_slots import claim_slots, claim_slots_torch


def make_region(B: int, W: int, bs: int, seed: int):
    """A region of ``B`` rows of ``W`` blocks each (distinct, shuffled block ids) with random
    fill levels (one row over its capacity, one empty) and random holes in the written slots."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * W + 3, generator=g)[:B * W].reshape(B, W).contiguous()
    length = torch.randint(0, W * bs + 1, (B,), generator=g)
    length[0], length[-1] = W * bs, 0  # a full row and an empty one
    valid = torch.rand((B * W + 3) * bs, generator=g) < 0.7
    return table, length, valid, g


def run(state, mask, backend, trash, bs, holes=True):
    table, length, valid = state
    length, blocks = length.clone(), torch.zeros_like(length)
    overflow = torch.zeros((), dtype=torch.int32, device=length.device)
    slot = claim_slots(table, length, blocks, valid, mask, trash, overflow, bs, backend=backend, holes=holes)
    return slot, length, blocks, overflow


@pytest.mark.parametrize("holes", [True, False])
@pytest.mark.parametrize("B,W,bs,N,seed", [(5, 3, 4, 4, 0), (4, 9, 16, 16, 1), (3, 70, 16, 12, 2), (6, 2, 8, 5, 3)])
def test_kernel_matches_reference(B, W, bs, N, seed, holes):
    table, length, valid, g = make_region(B, W, bs, seed)
    mask = torch.rand(B, N, generator=g) < 0.6
    mask[1] = True  # a row that writes all of its tokens, one that writes none
    mask[2] = False
    trash = (B * W + 2) * bs
    want = run((table, length, valid), mask, "torch", trash, bs, holes)
    got = run((table, length, valid), mask, "triton", trash, bs, holes)
    for a, b, name in zip(want, got, ("slot", "length", "num_blocks", "overflow")):
        assert torch.equal(a, b), name


def test_without_holes_every_token_is_appended():
    """``holes=False`` (nothing evicts in place): empty written slots are not looked for."""
    table = torch.tensor([[5, 2, 7]])
    valid = torch.zeros(40, dtype=torch.bool)
    valid[[20, 22, 23, 8, 10]] = True  # what would be holes at 21 and 9
    length = torch.tensor([6])
    blocks, overflow = torch.zeros(1, dtype=torch.long), torch.zeros((), dtype=torch.int32)
    mask = torch.tensor([[True, False, True, True]])
    slot = claim_slots_torch(table, length, blocks, valid, mask, 39, overflow, 4, holes=False)
    assert slot.tolist() == [10, 39, 11, 28] and length.tolist() == [9] and blocks.tolist() == [3]


def test_holes_first_in_block_order_then_appended():
    bs = 4
    table = torch.tensor([[5, 2, 7]])  # slots 20-23, then 8-11, then 28-31
    valid = torch.zeros(40, dtype=torch.bool)
    valid[[20, 22, 23, 8, 10]] = True  # written: 6 slots (20-23, 8, 9); holes at 21 and 9
    length = torch.tensor([6])
    blocks, overflow = torch.zeros(1, dtype=torch.long), torch.zeros((), dtype=torch.int32)
    mask = torch.tensor([[True, False, True, True, True]])
    slot = claim_slots_torch(table, length, blocks, valid, mask, 39, overflow, bs)
    assert slot.tolist() == [21, 39, 9, 10, 11]  # two holes, the trash slot, then the row's next slots
    assert length.tolist() == [8] and blocks.tolist() == [2] and int(overflow) == 0


def test_a_row_past_its_table_sets_overflow():
    table = torch.tensor([[0], [1]])
    valid = torch.ones(8, dtype=torch.bool)
    length = torch.tensor([4, 1])
    blocks, overflow = torch.zeros(2, dtype=torch.long), torch.zeros((), dtype=torch.int32)
    claim_slots_torch(table, length, blocks, valid, torch.tensor([[True], [False]]), 7, overflow, 4)
    assert int(overflow) == 1 and length.tolist() == [5, 1]


def reserved_region(B: int, W: int, bs: int, seed: int):
    """A region whose rows hold their first blocks only (-1 after them) and draw more from a row
    reserve of free ids (some rows with none left), with random holes in the written slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(2 * B * W + 3, generator=g)
    length = torch.randint(0, W * bs + 1, (B,), generator=g)
    length[0], length[-1] = W * bs, 0
    owned = (length + bs - 1) // bs
    cols = torch.arange(W)[None, :]
    table = torch.where(cols < owned[:, None], ids[:B * W].reshape(B, W), -1)
    stack = torch.cat([ids[B * W:2 * B * W].reshape(B, W), torch.full((B, 1), -1)], 1)
    count = torch.randint(0, W + 1, (B,), generator=g)
    count[1] = 0  # a row with an empty reserve
    valid = torch.rand((2 * B * W + 3) * bs, generator=g) < 0.7
    return table, length, valid, stack, count, g


def run_reserved(state, mask, backend, trash, bs):
    table, length, valid, stack, count = (t.clone() for t in state)
    blocks, overflow = torch.zeros_like(length), torch.zeros((), dtype=torch.int32, device=length.device)
    slot = claim_slots(table, length, blocks, valid, mask, trash, overflow, bs, (stack, count), backend=backend)
    return slot, table, length, blocks, count, overflow


@pytest.mark.parametrize("B,W,bs,N,seed", [(5, 3, 4, 4, 0), (4, 9, 16, 16, 1), (6, 4, 4, 9, 3)])
def test_kernel_matches_reference_with_a_row_reserve(B, W, bs, N, seed):
    table, length, valid, stack, count, g = reserved_region(B, W, bs, seed)
    mask = torch.rand(B, N, generator=g) < 0.7
    mask[1] = True  # the row without free blocks writes all of its tokens
    trash = (2 * B * W + 2) * bs
    want = run_reserved((table, length, valid, stack, count), mask, "torch", trash, bs)
    got = run_reserved((table, length, valid, stack, count), mask, "triton", trash, bs)
    for a, b, name in zip(want, got, ("slot", "table", "length", "num_blocks", "count", "overflow")):
        assert torch.equal(a, b), name


def test_new_blocks_come_off_the_row_reserve_newest_first():
    bs = 4
    table = torch.tensor([[5, -1, -1], [2, 3, -1]])  # row 0: 3 slots written; row 1: 8, block 3 full
    valid = torch.ones(64, dtype=torch.bool)
    valid[5 * bs + 3:6 * bs] = False  # row 0's unwritten slot
    length = torch.tensor([3, 8])
    stack = torch.tensor([[9, 4, 11, -1], [7, -1, -1, -1]])
    count = torch.tensor([3, 1])
    blocks, overflow = torch.zeros(2, dtype=torch.long), torch.zeros((), dtype=torch.int32)
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    slot = claim_slots_torch(table, length, blocks, valid, mask, 63, overflow, bs, (stack, count))
    assert slot.view(2, 6).tolist() == [[23, 44, 45, 46, 47, 16], [28, 29, 63, 63, 63, 63]]
    assert table.tolist() == [[5, 11, 4], [2, 3, 7]]  # block 11, the top of row 0's stack, first
    assert count.tolist() == [1, 0] and length.tolist() == [9, 10] and int(overflow) == 0


def test_a_row_without_free_blocks_sets_overflow_and_writes_to_the_trash():
    table = torch.tensor([[0, -1]])
    valid = torch.ones(12, dtype=torch.bool)
    length, count = torch.tensor([4]), torch.tensor([0])
    blocks, overflow = torch.zeros(1, dtype=torch.long), torch.zeros((), dtype=torch.int32)
    slot = claim_slots_torch(table, length, blocks, valid, torch.tensor([[True, True]]), 11, overflow, 4,
                             (torch.tensor([[2, -1]]), count))
    assert slot.tolist() == [11, 11] and int(overflow) == 1 and table.tolist() == [[0, -1]]


def test_bad_input_is_named():
    table = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="int64"):
        claim_slots(table.int(), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                    torch.ones(4, dtype=torch.bool), torch.ones(2, 1, dtype=torch.bool), 3,
                    torch.zeros((), dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="rows"):
        claim_slots(table, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                    torch.ones(4, dtype=torch.bool), torch.ones(3, 1, dtype=torch.bool), 3,
                    torch.zeros((), dtype=torch.int32), 2)


@pytest.mark.gpu
def test_kernel_matches_reference_on_gpu():
    B, W, bs, N = 16, 600, 16, 16  # a long row: several iterations of the scan for holes
    table, length, valid, g = make_region(B, W, bs, 7)
    mask = torch.rand(B, N, generator=g) < 0.6
    state = tuple(t.cuda() for t in (table, length, valid))
    want = run(state, mask.cuda(), "torch", (B * W + 2) * bs, bs)
    got = run(state, mask.cuda(), None, (B * W + 2) * bs, bs)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    table, length, valid, stack, count, g = reserved_region(B, 40, bs, 8)
    state = tuple(t.cuda() for t in (table, length, valid, stack, count))
    mask = (torch.rand(B, N, generator=g) < 0.7).cuda()
    want = run_reserved(state, mask, "torch", (2 * B * 40 + 2) * bs, bs)
    got = run_reserved(state, mask, None, (2 * B * 40 + 2) * bs, bs)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
