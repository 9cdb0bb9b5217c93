"""The one-launch buffer append of static decode (ops/append_token.py): kernel == torch reference."""

import copy

import pytest
import torch

from kvcompose.ops.append_token import append_token

B, CAP, H, D = 4, 5, 2, 8


def make_state(dtype, channels: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    meta = {"pos": torch.full((B, CAP), -1, dtype=torch.long), "valid": torch.zeros(B, CAP, dtype=torch.bool),
            "cls": torch.zeros(B, CAP, dtype=torch.long)}
    for i in range(channels):  # float slot channels (h2o's mass); the kernel zeroes the first, a fill the rest
        meta[f"acc{i}"] = torch.rand(B, CAP, generator=g)
    return {"buf_k": torch.randn(B, CAP, H, D, generator=g).to(dtype), "buf_v": torch.randn(B, CAP, H, D, generator=g).to(dtype),
            "meta": meta, "buf_len": torch.tensor([0, 3, CAP - 1, 2]), "tokens_seen": torch.tensor([5, 9, 7, 0]),
            "column": torch.full((B,), 17), "overflow": torch.zeros((), dtype=torch.int32),
            "nonfinite": torch.zeros(1, dtype=torch.int32)}


def run(state, keys, values, cls, backend):
    s = copy.deepcopy(state)
    positions = append_token(keys, values, s["buf_k"], s["buf_v"], s["meta"], s["buf_len"], s["tokens_seen"],
                             s["column"], cls, s["overflow"], s["nonfinite"], backend=backend)
    return positions, s


def assert_same(a, b):
    for key in a:
        if key == "meta":
            for name in a["meta"]:
                assert torch.equal(a["meta"][name], b["meta"][name]), name
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels", [0, 1, 2])
def test_kernel_matches_reference(dtype, channels):
    g = torch.Generator().manual_seed(1)
    state = make_state(dtype, channels)
    keys = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)  # [B, H, 1, D] as a view, as models pass them
    values = torch.randn(B, H, 1, D, generator=g).to(dtype)
    cls = torch.tensor([2, 0, 1, 3])
    pos_ref, ref = run(state, keys, values, cls, "torch")
    pos, got = run(state, keys, values, cls, "triton")
    assert torch.equal(pos, pos_ref) and pos_ref.tolist() == [[17]] * B
    assert_same(got, ref)
    assert ref["buf_len"].tolist() == [1, 4, CAP, 3] and ref["column"].tolist() == [18] * B  # advanced in the launch
    assert ref["meta"]["valid"][1, 3] and ref["meta"]["cls"][0, 0] == 2 and torch.equal(ref["buf_k"][1, 3], keys[1, :, 0])
    assert ref["overflow"].item() == 0 and ref["nonfinite"].item() == 0
    for i in range(channels):
        assert ref["meta"][f"acc{i}"][1, 3] == 0 and ref["meta"][f"acc{i}"][2, CAP - 2] != 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_full_buffer_and_non_finite_values_raise_their_flags(backend):
    state = make_state(torch.float32, 0)
    state["buf_len"][2] = CAP  # the schedule should have flushed this row
    keys, values = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    values[3, 1, 0, 5] = float("nan")
    _, s = run(state, keys, values, torch.zeros(B, dtype=torch.long), backend)
    assert s["overflow"].item() == 1 and s["nonfinite"].item() == 1
    assert torch.equal(s["buf_k"][2, CAP - 1], keys[2, :, 0])  # written over the last slot
    keys[0, 0, 0, 0] = float("inf")
    values[3, 1, 0, 5] = 0.0
    _, s = run(make_state(torch.float32, 0), keys, values, torch.zeros(B, dtype=torch.long), backend)
    assert s["nonfinite"].item() == 1 and s["overflow"].item() == 0


def test_bad_shapes_and_metadata_are_named():
    state = make_state(torch.float32, 0)
    keys = torch.randn(B, H, 1, D)
    with pytest.raises(ValueError, match=r"keys of shape \(4, 2, 2, 8\)"):
        run(state, torch.randn(B, H, 2, D), keys, torch.zeros(B, dtype=torch.long), "torch")
    with pytest.raises(ValueError, match="dtype torch.float16"):
        run(state, keys.half(), keys, torch.zeros(B, dtype=torch.long), "torch")
    del state["meta"]["cls"]
    with pytest.raises(ValueError, match=r"lacks \['cls'\]"):
        run(state, keys, keys, torch.zeros(B, dtype=torch.long), "torch")
    with pytest.raises(ValueError, match=r"classes of shape \(3,\)"):
        run(make_state(torch.float32, 0), keys, keys, torch.zeros(3, dtype=torch.long), "torch")
    zero_d = make_state(torch.float32, 0)
    zero_d["column"] = torch.tensor(17)
    with pytest.raises(ValueError, match=r"column of shape \(\) .* contiguous int64 \[4\] tensor"):
        run(zero_d, keys, keys, torch.zeros(B, dtype=torch.long), "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_query_ring_takes_the_step_query_at_slot_column_mod_window(backend):
    g = torch.Generator().manual_seed(3)
    Hq, W = 4, 3
    state = make_state(torch.bfloat16, 0)
    ring_q = torch.randn(B, Hq, W, D, generator=g).to(torch.bfloat16)
    ring_pos = torch.randint(0, 9, (B, W), generator=g)
    query = torch.randn(B, 1, Hq, D, generator=g).to(torch.bfloat16).transpose(1, 2)  # a view, as models pass it
    keys, values = torch.randn(2, B, H, 1, D, generator=g).to(torch.bfloat16)
    want_q, want_pos = ring_q.clone(), ring_pos.clone()
    want_q[:, :, 17 % W] = query[:, :, 0]
    want_pos[:, 17 % W] = 17
    s = copy.deepcopy(state)
    append_token(keys, values, s["buf_k"], s["buf_v"], s["meta"], s["buf_len"], s["tokens_seen"], s["column"],
                 torch.zeros(B, dtype=torch.long), s["overflow"], s["nonfinite"], ring=(query, ring_q, ring_pos),
                 backend=backend)
    assert torch.equal(ring_q, want_q) and torch.equal(ring_pos, want_pos)
    _, plain = run(state, keys, values, torch.zeros(B, dtype=torch.long), backend)
    assert_same(s, plain)  # the ring changes nothing else


def test_a_bad_query_ring_is_named():
    state = make_state(torch.float32, 0)
    keys = torch.randn(B, H, 1, D)
    ring_q, ring_pos = torch.zeros(B, 4, 3, D), torch.zeros(B, 3, dtype=torch.long)
    args = (keys, keys, state["buf_k"], state["buf_v"], state["meta"], state["buf_len"], state["tokens_seen"],
            state["column"], torch.zeros(B, dtype=torch.long), state["overflow"], state["nonfinite"])
    with pytest.raises(ValueError, match=r"query of shape \(4, 4, 2, 8\)"):
        append_token(*args, ring=(torch.zeros(B, 4, 2, D), ring_q, ring_pos))
    with pytest.raises(ValueError, match="ring positions"):
        append_token(*args, ring=(torch.zeros(B, 4, 1, D), ring_q, ring_pos.int()))
    with pytest.raises(ValueError, match="contiguous"):
        append_token(*args, ring=(torch.zeros(B, 4, 1, D), ring_q.transpose(2, 3), ring_pos))
