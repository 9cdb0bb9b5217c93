"""The one-token in-place eviction op (ops/evict_one.py): kernel == torch reference == keep_top."""

import copy

import pytest
import torch

from kvcompose.evictors.base import EvictionContext, keep_top
from kvcompose.ops.evict_one import evict_one_in_place, evict_one_in_place_torch

BS, W, CAP, H, D = 4, 5, 6, 2, 8


def make_state(seed: int, budget: int, channel: bool, extra: int = 1):
    """Rows whose live tokens (pool holes included) number budget - 1, budget, budget + extra
    or fewer; unique positions per row; integer-valued scores so that ties happen."""
    g = torch.Generator().manual_seed(seed)
    B = 5
    slots_total = (B * W + 2) * BS
    perm = torch.randperm(B * W + 2, generator=g)[: B * W].view(B, W)  # blocks of each row, scattered
    table = perm.clone()
    table[4, 3:] = -1  # a row with missing blocks
    pool = {"pos": torch.full((slots_total,), -1, dtype=torch.long),
            "valid": torch.zeros(slots_total, dtype=torch.bool)}
    buffer = {"k": torch.zeros(B, CAP, H, D), "v": torch.zeros(B, CAP, H, D),
              "pos": torch.full((B, CAP), -1, dtype=torch.long), "valid": torch.zeros(B, CAP, dtype=torch.bool),
              "cls": torch.zeros(B, CAP, dtype=torch.long)}
    if channel:
        pool["acc"] = torch.zeros(slots_total)
        buffer["acc"] = torch.zeros(B, CAP)
    buf_len = torch.zeros(B, dtype=torch.long)
    targets = [budget + extra, budget, budget + extra, budget - 1, budget + extra]
    for b in range(B):
        blocks = table[b][table[b] >= 0]
        in_buffer = int(torch.randint(0, CAP, (1,), generator=g))
        in_pool = max(targets[b] - in_buffer, 0)
        slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)
        chosen = slots[torch.randperm(slots.numel(), generator=g)[:in_pool]]
        n = in_pool + in_buffer
        positions = torch.sort(torch.randperm(3 * n + 3, generator=g)[:n]).values + 2
        pool_pos = positions[torch.randperm(n, generator=g)[:in_pool]] if in_pool else positions[:0]
        rest = torch.tensor(sorted(set(positions.tolist()) - set(pool_pos.tolist())), dtype=torch.long)
        pool["pos"][chosen] = pool_pos
        pool["valid"][chosen] = True
        buffer["pos"][b, :in_buffer] = rest[-in_buffer:] if in_buffer else rest[:0]
        buffer["valid"][b, :in_buffer] = True
        buffer["k"][b, :in_buffer] = torch.randn(in_buffer, H, D, generator=g)
        buffer["v"][b, :in_buffer] = torch.randn(in_buffer, H, D, generator=g)
        buffer["cls"][b, :in_buffer] = torch.randint(0, 3, (in_buffer,), generator=g)
        buf_len[b] = in_buffer
        if channel:
            pool["acc"][chosen] = torch.randint(0, 4, (in_pool,), generator=g).float()
            buffer["acc"][b, :in_buffer] = torch.randint(0, 4, (in_buffer,), generator=g).float()
    return table, pool, buffer, buf_len


def run(fn, state, **kw):
    table, pool, buffer, buf_len = copy.deepcopy(state)
    bad = torch.zeros((), dtype=torch.int32, device=table.device)
    evicted = fn(table, BS, pool, buffer, buf_len, bad=bad, **kw)
    return evicted, pool, buffer, buf_len, bad


def kept_positions(table, pool, buffer):
    rows = []
    for b in range(table.shape[0]):
        blocks = table[b][table[b] >= 0]
        slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)
        live = pool["pos"][slots][pool["valid"][slots]].tolist() + buffer["pos"][b][buffer["valid"][b]].tolist()
        rows.append(sorted(live))
    return rows


CASES = [dict(sinks=s, recent=r, protect_prompt=p, channel=c)
         for s, r, p, c in [(0, 0, False, False), (2, 0, False, False), (2, 3, False, True), (0, 3, True, True),
                            (1, 40, False, True), (3, 2, True, False)]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{int(v)}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_and_keep_top(case, seed):
    budget = 9
    channel = case["channel"]
    state = make_state(seed, budget, channel)
    kw = dict(budget=budget, sinks=case["sinks"], recent=case["recent"], prompt_columns=12,
              protect_prompt=case["protect_prompt"], score_channel="acc" if channel else None)
    want = run(evict_one_in_place_torch, state, **kw)
    got = run(lambda *a, **k: evict_one_in_place(*a, backend="triton", **k), state, **kw)
    assert torch.equal(want[0], got[0])
    for a, b in zip(want[1:3], got[1:3]):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(want[3], got[3]) and int(want[4]) == int(got[4]) == 0
    # The same token as keep_top keeping all but one (the generic in-place path).
    table, pool, buffer, _ = state
    after = kept_positions(table, got[1], got[2])
    for b, before in enumerate(kept_positions(table, pool, buffer)):
        pos = torch.tensor(before)
        if len(before) <= budget:
            assert after[b] == before
            continue
        valid = torch.ones(1, len(before), dtype=torch.bool)
        age = torch.arange(len(before))
        protected = (age < case["sinks"]) | (age >= len(before) - case["recent"])
        if case["protect_prompt"]:
            protected |= pos < 12
        if channel:
            row_slots = (table[b][table[b] >= 0][:, None] * BS + torch.arange(BS)).reshape(-1).tolist()
            slots_of = {int(pool["pos"][s]): s for s in row_slots if pool["valid"][s]}
            score = torch.tensor([float(pool["acc"][slots_of[p]]) if p in slots_of else
                                  float(buffer["acc"][b][buffer["pos"][b] == p][0]) for p in before])
        else:
            score = pos.float()
        ctx = EvictionContext(keys=None, positions=pos[None], valid=valid, keep=torch.tensor([budget]),
                              protected=protected[None])
        keep = keep_top(score[None], ctx)[0]
        assert after[b] == pos[keep].tolist()
    # A dropped buffer token is closed up: live tokens stay at the front, in order.
    live = got[2]["valid"]
    assert torch.equal(live, torch.arange(CAP)[None, :] < got[3][:, None])


def test_more_than_one_token_over_budget_sets_bad():
    state = make_state(3, 9, False, extra=2)
    for fn in (evict_one_in_place_torch, lambda *a, **k: evict_one_in_place(*a, backend="triton", **k)):
        *_, bad = run(fn, state, budget=9, sinks=0, recent=0, prompt_columns=0, protect_prompt=False,
                      score_channel=None)
        assert int(bad) == 1


def test_refuses_channels_it_would_not_move():
    table, pool, buffer, buf_len = make_state(0, 9, True)
    buffer["other"] = torch.zeros_like(buffer["acc"])
    with pytest.raises(ValueError, match=r"\['other'\] are not moved"):
        evict_one_in_place(table, BS, pool, buffer, buf_len, budget=9, sinks=0, recent=0, prompt_columns=0,
                           protect_prompt=False, score_channel="acc", bad=torch.zeros((), dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_kernel_matches_reference():
    for case in CASES:
        state = make_state(7, 9, case["channel"])
        kw = dict(budget=9, sinks=case["sinks"], recent=case["recent"], prompt_columns=12,
                  protect_prompt=case["protect_prompt"], score_channel="acc" if case["channel"] else None)
        want = run(evict_one_in_place_torch, state, **kw)
        cuda_state = tuple({n: t.cuda() for n, t in x.items()} if isinstance(x, dict) else x.cuda() for x in state)
        got = run(evict_one_in_place, cuda_state, **kw)
        assert torch.equal(want[0], got[0].cpu())
        for a, b in zip(want[1:3], got[1:3]):
            assert all(torch.equal(a[n], b[n].cpu()) for n in a)
        assert torch.equal(want[3], got[3].cpu())
