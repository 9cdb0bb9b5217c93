"""LayerStore.keys_at: the keys of a few columns of a view, decoded for those columns alone when the view
holds no keys (what ThinKV's K-means reads at an eviction), equal to the keys a full view decodes."""

import pytest
import torch

from kvcompose import Policy
from kvcompose.pagers import ContinuousThinkingPager
from kvcompose.paging import LayerStore
from kvcompose.quantizers.codec import QuantCodec

from test_decoded_copy import PRECISIONS, torch_encoders  # noqa: F401 (the fixture encodes with torch)

H, D, B = 2, 64, 3


def filled(name: str, holes: bool) -> LayerStore:
    policy = Policy(precision=PRECISIONS[name], group_size=16, residual=4)
    codecs = {c: QuantCodec(q, H, D, "cpu") for c, q in policy.precision.items()}
    store = LayerStore(B, H, D, torch.float32, torch.device("cpu"), group_size=16, residual=4, codecs=codecs)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, H, 70, D, generator=g)
    real = torch.ones(B, 70, dtype=torch.bool)
    real[1, :9] = False  # a left-padded row
    store.append(k, k * 0.5, real, torch.randint(0, len(store.regions), (B, 70), generator=g))
    if holes:  # in-place eviction: empty slots among the written ones
        view = store.view(values=False)
        ContinuousThinkingPager().compact(store, view, view.valid & (view.positions % 3 != 0))
    return store


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("name", ["nvfp4", "thinkv", "int2", "fp8"])
def test_keys_of_a_few_columns_equal_the_full_views(name, holes):
    store = filled(name, holes)
    full, bare = store.view(values=False), store.view(values=False, keys=False)
    assert bare.keys is None and torch.equal(bare.valid, full.valid) and torch.equal(bare.phys, full.phys)
    g = torch.Generator().manual_seed(1)
    L = full.valid.shape[1]
    rows = torch.tensor([0, 2, 1, 0])
    cols = torch.randint(0, L, (4, 9), generator=g)
    cols[0, :3] = torch.tensor([0, full.block_columns, L - 1])  # the first column, the buffer's first, the last
    want = full.keys[rows[:, None].expand_as(cols), :, cols].reshape(4, 9, H * D)
    live = full.valid[rows[:, None].expand_as(cols), cols]
    assert live.any() and (~live).any()
    got = store.keys_at(bare, rows, cols)
    assert got.shape == (4, 9, H * D)
    assert torch.equal(got[live], want[live])  # live tokens: the very keys of the full decode
    assert torch.equal(store.keys_at(full, rows, cols), want)


def test_a_view_with_values_has_keys():
    with pytest.raises(ValueError, match="keys=False needs values=False"):
        filled("nvfp4", False).view(keys=False)
