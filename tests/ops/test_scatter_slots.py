"""Masked slot writes of static decode (ops/scatter_slots.py): kernel == torch reference, and the
reference writes exactly the masked entries (the trash slot takes the rest)."""

import pytest
import torch

from kvcompose.ops import scatter_slots

from kvcompose.ops.paged_attention.formats import to_head_major
from kvcompose.ops.scatter_slots import (copy_slots, fill_slots, gather_slots, gather_slots_many, gather_slots_torch,
                                        move_slots, move_slots_many, pack_slots, write_slots)

SLOTS, TRASH = 64, 63


def per_slot(kind: str, g: torch.Generator) -> torch.Tensor:
    """A pool's per-slot tensor of each layout kvcompose stores (channels, codes, scales)."""
    if kind == "valid":
        return torch.rand(SLOTS, generator=g) < 0.5
    if kind == "pos":
        return torch.randint(-1, 1000, (SLOTS,), generator=g)
    if kind == "mass":
        return torch.rand(SLOTS, generator=g)
    if kind.startswith("head "):  # each head's rows together (a head-major pool)
        return to_head_major(per_slot(kind[5:], g))
    if kind == "scales":  # one fp16 per head: a head's row is one value
        return torch.rand(SLOTS, 3, generator=g).half()
    if kind == "codes":  # 2 heads x 24 bytes: whole words
        return torch.randint(0, 256, (SLOTS, 2, 24), generator=g, dtype=torch.uint8)
    return torch.randint(0, 256, (SLOTS, 3, 3), generator=g, dtype=torch.uint8)  # 9 bytes a slot: bytes


def grid(g: torch.Generator, B: int = 3, L: int = 7):
    """Distinct source and target slots (never both), masked at random, the trash slot unused."""
    slots = torch.randperm(TRASH, generator=g)[:2 * B * L]
    mask = torch.rand(B, L, generator=g) < 0.6
    return slots[:B * L].view(B, L), slots[B * L:].view(B, L), mask


def on_both(op, flat: torch.Tensor, *args, backend: str = "triton") -> torch.Tensor:
    """``op`` on copies of ``flat`` through the torch reference and ``backend``: the reference's
    result, once the two agree on every slot but the trash slot."""
    want, got = flat.clone(), flat.clone()
    op(want, *args, TRASH, backend="torch")
    op(got, *args, TRASH, backend=backend)
    assert torch.equal(want[:TRASH], got[:TRASH])
    return want


@pytest.mark.parametrize("kind", ["valid", "pos", "mass", "codes", "bytes", "head codes", "head bytes", "head scales"])
def test_copy_kernel_matches_reference(kind):
    g = torch.Generator().manual_seed(len(kind))
    flat = per_slot(kind, g)
    assert flat.is_contiguous() != kind.startswith("head ")  # head-major rows take the per-head path
    source, target, mask = grid(g)
    want = on_both(copy_slots, flat, source, target, mask)
    moved = target[mask]
    assert torch.equal(want[moved], flat[source[mask]])  # the masked entries moved
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[moved] = False
    untouched[TRASH] = False
    assert torch.equal(want[untouched], flat[untouched])  # and nothing else changed


@pytest.mark.parametrize("kind,value", [("valid", False), ("pos", -1), ("mass", 0.0)])
def test_fill_kernel_matches_reference(kind, value):
    g = torch.Generator().manual_seed(3)
    flat = per_slot(kind, g)
    index, _, mask = grid(g)
    want = on_both(fill_slots, flat, index, mask, value)
    assert bool((want[index[mask]] == value).all())
    kept = index[~mask]
    assert torch.equal(want[kept], flat[kept])


def compaction(g: torch.Generator, B: int = 3, L: int = 9):
    """Each row's kept slots move, in order, to the row's first slots: sources are targets too."""
    phys = torch.randperm(TRASH, generator=g)[:B * L].view(B, L)
    kept = torch.rand(B, L, generator=g) < 0.6
    order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
    source = phys.gather(1, order)
    live = torch.arange(L)[None, :] < kept.sum(1, keepdim=True)
    return source, phys, live & (source != phys)


@pytest.mark.parametrize("kind", ["valid", "pos", "mass", "codes", "bytes", "head codes", "head bytes", "head scales"])
def test_move_kernel_matches_reference(kind):
    g = torch.Generator().manual_seed(11 + len(kind))
    flat = per_slot(kind, g)
    source, target, mask = compaction(g)
    assert bool(mask.any()) and bool(torch.isin(target[mask], source[mask]).any())  # overlapping moves
    want = on_both(move_slots, flat, source, target, mask)
    assert torch.equal(want[target[mask]], flat[source[mask]])  # each target has its source's old row
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[target[mask]] = False
    untouched[TRASH] = False
    assert torch.equal(want[untouched], flat[untouched])


@pytest.mark.parametrize("kind", ["valid", "pos", "mass", "codes", "bytes", "head codes", "head bytes", "head scales"])
def test_gather_kernel_matches_reference(kind):
    g = torch.Generator().manual_seed(21 + len(kind))
    flat = per_slot(kind, g)
    index, _, mask = grid(g)
    index = torch.where(mask, index, -1)  # anything where masked out
    got = gather_slots(flat, index, mask, backend="triton")
    want = gather_slots_torch(flat, index, mask)
    assert got.is_contiguous() and got.shape == (*mask.shape, *flat.shape[1:])
    assert torch.equal(got, want)
    assert torch.equal(want[mask], flat[index[mask]])
    assert not bool(want[~mask].any())  # zeros where masked out


def test_bad_input_is_named():
    flat = torch.zeros(SLOTS)
    index = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="int64"):
        fill_slots(flat, index.int(), torch.ones(2, 3, dtype=torch.bool), 0.0, TRASH)
    with pytest.raises(ValueError, match="mask's shape"):
        copy_slots(flat, index, index[:, :2], torch.ones(2, 3, dtype=torch.bool), TRASH)
    with pytest.raises(ValueError, match="one value per slot"):
        fill_slots(torch.zeros(SLOTS, 4), index, torch.ones(2, 3, dtype=torch.bool), 0.0, TRASH)


#: A pool as a pack moves it: payload of several layouts, then metadata channels with their empty values.
POOL = [("head codes", None), ("head scales", None), ("bytes", None), ("valid", 0), ("pos", -1), ("mass", 0)]


def pack_on_both(flats, source, target, mask, clear, backend="triton"):
    """``pack_slots`` through the reference and ``backend`` on copies of ``flats``: the reference's results."""
    want, got = [f.clone() for f in flats], [f.clone() for f in flats]
    pack_slots(want, source, target, mask, TRASH, clear, backend="torch")
    pack_slots(got, source, target, mask, TRASH, clear, backend=backend)
    for w, x in zip(want, got):
        assert torch.equal(w[:TRASH], x[:TRASH])
    return want


def test_pack_moves_every_tensor_in_one_launch_and_clears_sources(monkeypatch):
    g = torch.Generator().manual_seed(41)
    flats = [per_slot(kind, g) for kind, _ in POOL]
    clear = [value for _, value in POOL]
    source, target, mask = grid(g)
    launches = []
    run = type(scatter_slots._copy_kernel).run
    monkeypatch.setattr(type(scatter_slots._copy_kernel), "run", lambda *a, **k: launches.append(1) or run(*a, **k))
    want = pack_on_both(flats, source, target, mask, clear)
    assert len(launches) == 1
    for flat, after, value in zip(flats, want, clear):
        assert torch.equal(after[target[mask]], flat[source[mask]])  # every tensor's masked entries moved
        gone = after[source[mask]]
        if value is None:
            assert torch.equal(gone, flat[source[mask]])  # payload stays where it was read
        else:
            assert bool((gone == value).all())  # metadata of a moved-from slot is empty
        untouched = torch.ones(SLOTS, dtype=torch.bool)
        untouched[target[mask]] = untouched[source[mask]] = untouched[TRASH] = False
        assert torch.equal(after[untouched], flat[untouched])


def test_move_and_gather_many_take_one_launch_each(monkeypatch):
    """A compaction of a whole pool: its payload and metadata (with their empty values) move in
    two launches per group, the same as tensor by tensor through the reference."""
    g = torch.Generator().manual_seed(45)
    flats = [per_slot(kind, g) for kind, _ in POOL]
    fill = [value or 0 for _, value in POOL]
    source, target, mask = compaction(g)
    launches = []
    run = type(scatter_slots._copy_kernel).run
    monkeypatch.setattr(type(scatter_slots._copy_kernel), "run", lambda *a, **k: launches.append(1) or run(*a, **k))
    got = [f.clone() for f in flats]
    move_slots_many(got, source, target, mask, TRASH, backend="triton", fill=fill)
    assert len(launches) == 2
    for flat, after, value in zip(flats, got, fill):
        want = flat.clone()
        move_slots(want, source, target, mask, TRASH, backend="torch", fill=value)
        assert torch.equal(want[:TRASH], after[:TRASH])
    payload = [f.clone() for f, (_, value) in zip(flats, POOL) if value is None]
    want = [f.clone() for f in payload]
    move_slots_many(payload, source, target, mask, TRASH, backend="triton")  # a compaction's payload: no fill
    assert len(launches) == 4
    for w, x in zip(want, payload):
        move_slots(w, source, target, mask, TRASH, backend="torch")
        assert torch.equal(w[:TRASH], x[:TRASH])
    index = torch.where(mask, source, -1)
    gathered = gather_slots_many(flats, index, mask, backend="triton", fill=fill)
    assert len(launches) == 5
    for flat, out, value in zip(flats, gathered, fill):
        assert torch.equal(out, gather_slots_torch(flat, index, mask, value))


def test_write_puts_every_tensor_of_new_tokens_in_one_launch(monkeypatch):
    """An append of encoded tokens: each tensor's rows land at their slots (the trash slot takes repeats)."""
    g = torch.Generator().manual_seed(49)
    flats = [per_slot(kind, g) for kind, _ in POOL]
    index = torch.cat([torch.randperm(TRASH, generator=g)[:9], torch.full((3,), TRASH)])
    rows = [per_slot(kind, g)[:index.numel()].contiguous() for kind, _ in POOL]
    launches = []
    run = type(scatter_slots._copy_kernel).run
    monkeypatch.setattr(type(scatter_slots._copy_kernel), "run", lambda *a, **k: launches.append(1) or run(*a, **k))
    want, got = [f.clone() for f in flats], [f.clone() for f in flats]
    write_slots(want, rows, index, backend="torch")
    write_slots(got, rows, index, backend="triton")
    assert len(launches) == 1
    for flat, w, x, row in zip(flats, want, got, rows):
        assert torch.equal(w[:TRASH], x[:TRASH])
        assert torch.equal(w[index[:9]], row[:9])
        untouched = torch.ones(SLOTS, dtype=torch.bool)
        untouched[index] = False
        assert torch.equal(w[untouched], flat[untouched])


def test_write_refuses_rows_that_do_not_match():
    g = torch.Generator().manual_seed(51)
    flat, index = per_slot("pos", g), torch.arange(4)
    with pytest.raises(ValueError, match=r"rows to write must be torch.int64 of shape \(4,\); got torch.int32"):
        write_slots([flat], [torch.zeros(4, dtype=torch.int32)], index)
    with pytest.raises(ValueError, match="1-d int64"):
        write_slots([flat], [torch.zeros(4, dtype=torch.long)], index.int())
    with pytest.raises(ValueError, match="one tensor of rows per per-slot tensor; got 2 for 1"):
        write_slots([flat], [flat[:4], flat[:4]], index)


def test_pack_refuses_bad_clear_values():
    g = torch.Generator().manual_seed(43)
    source, target, mask = grid(g)
    flats = [per_slot("pos", g), per_slot("mass", g)]
    with pytest.raises(ValueError, match="one clear value"):
        pack_slots(flats, source, target, mask, TRASH, [None])
    with pytest.raises(ValueError, match="fill must be 0, or -1 for an integer tensor; got -1"):
        pack_slots(flats, source, target, mask, TRASH, [-1, -1])
    with pytest.raises(ValueError, match="one fill value per tensor; got 1 for 2"):
        move_slots_many(flats, source, target, mask, TRASH, fill=[0])
    with pytest.raises(ValueError, match=r"per tensor, or None; got \[-1, None\]"):
        move_slots_many(flats, source, target, mask, TRASH, fill=[-1, None])
    with pytest.raises(ValueError, match="no per-slot tensors"):
        gather_slots_many([], source, mask)


@pytest.mark.gpu
def test_many_tensor_moves_match_reference_on_gpu():
    g = torch.Generator().manual_seed(47)
    flats = [per_slot(kind, g).cuda() for kind, _ in POOL]
    source, target, mask = (t.cuda() for t in grid(g))
    pack_on_both(flats, source, target, mask, [value for _, value in POOL], backend=None)
    frm, to, moving = (t.cuda() for t in compaction(g))
    fill = [value or 0 for _, value in POOL]
    want, got = [f.clone() for f in flats], [f.clone() for f in flats]
    move_slots_many(want, frm, to, moving, TRASH, backend="torch", fill=fill)
    move_slots_many(got, frm, to, moving, TRASH, fill=fill)
    for w, x in zip(want, got):
        assert torch.equal(w[:TRASH], x[:TRASH])
    index = torch.randperm(TRASH, generator=g)[:9].cuda()
    rows = [per_slot(kind, g)[:9].contiguous().cuda() for kind, _ in POOL]
    write_slots(want, rows, index, backend="torch")
    write_slots(got, rows, index)
    for w, x in zip(want, got):
        assert torch.equal(w[:TRASH], x[:TRASH])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["valid", "pos", "codes", "bytes", "head codes"])
def test_kernels_match_reference_on_gpu(kind):
    g = torch.Generator().manual_seed(5)
    flat = per_slot(kind, g).cuda()
    source, target, mask = (t.cuda() for t in grid(g))
    on_both(copy_slots, flat, source, target, mask, backend=None)
    frm, to, moving = (t.cuda() for t in compaction(g))
    on_both(move_slots, flat, frm, to, moving, backend=None)
    assert torch.equal(gather_slots(flat, frm, moving), gather_slots_torch(flat, frm, moving))
    if flat.dim() == 1:
        on_both(fill_slots, flat, source, mask, False if kind == "valid" else -1, backend=None)
    fill = -1 if kind == "pos" else 0
    want, got = flat.clone(), flat.clone()
    move_slots(want, frm, to, moving, TRASH, backend="torch", fill=fill)
    move_slots(got, frm, to, moving, TRASH, fill=fill)
    assert torch.equal(want[:TRASH], got[:TRASH])


@pytest.mark.parametrize("kind,fill", [("valid", 0), ("pos", -1), ("mass", 0), ("head codes", 0)])
def test_move_with_fill_writes_every_target(kind, fill):
    """A compaction's metadata: kept entries move, every other target becomes empty."""
    g = torch.Generator().manual_seed(31 + len(kind))
    flat = per_slot(kind, g)
    source, target, mask = compaction(g)
    want, got = flat.clone(), flat.clone()
    move_slots(want, source, target, mask, TRASH, backend="torch", fill=fill)
    move_slots(got, source, target, mask, TRASH, backend="triton", fill=fill)
    assert torch.equal(want[:TRASH], got[:TRASH])
    assert torch.equal(want[target[mask]], flat[source[mask]])
    assert bool((want[target[~mask]] == fill).all())
    assert torch.equal(gather_slots(flat, source, mask, backend="triton", fill=fill),
                       gather_slots_torch(flat, source, mask, fill))


def test_fill_must_be_whole_words():
    index = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="fill must be 0, or -1 for an integer tensor"):
        gather_slots(torch.zeros(SLOTS), index, mask, fill=-1)
    with pytest.raises(ValueError, match="fill must be 0"):
        move_slots(torch.zeros(SLOTS, dtype=torch.long), index, index, mask, TRASH, fill=5)
