"""In-place row compaction (ops/compact_rows.py): kernel == torch reference, and the reference keeps
each row's kept entries in order at its front, with the fill value after them."""

import pytest
import torch

from kvcompose.ops.compact_rows import compact_rows_, compact_rows_torch


def buffer_tensor(kind: str, B: int, N: int, g: torch.Generator) -> torch.Tensor:
    """The per-row tensors of a store's recent buffer: keys/values, and metadata channels."""
    if kind == "keys":  # [B, N, H, D] bf16: whole words
        return torch.randn(B, N, 2, 6, generator=g).bfloat16()
    if kind == "odd":  # 3 bytes an entry: no whole words
        return torch.randint(0, 256, (B, N, 3), generator=g, dtype=torch.uint8)
    if kind == "valid":
        return torch.rand(B, N, generator=g) < 0.5
    if kind == "pos":
        return torch.randint(0, 1000, (B, N), generator=g)
    return torch.rand(B, N, generator=g)  # a float channel


@pytest.mark.parametrize("kind,fill", [("keys", 0), ("odd", 0), ("valid", 0), ("pos", -1), ("mass", 0)])
@pytest.mark.parametrize("N", [5, 16])
def test_kernel_matches_reference(kind, fill, N):
    g = torch.Generator().manual_seed(N + len(kind))
    B = 4
    x = buffer_tensor(kind, B, N, g)
    keep = torch.rand(B, N, generator=g) < 0.5
    keep[0] = False  # a row that keeps nothing
    keep[1] = True  # and one that keeps everything
    want = compact_rows_torch(x.clone(), keep, fill)
    got = compact_rows_(x.clone(), keep, fill, backend="triton")
    assert torch.equal(got, want)
    for b in range(B):
        n = int(keep[b].sum())
        assert torch.equal(want[b, :n], x[b][keep[b]])  # the kept entries, in order
        assert bool((want[b, n:] == fill).all())


def test_bad_input_is_named():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="bool of shape"):
        compact_rows_(x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous"):
        compact_rows_(x.transpose(1, 2), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="fill must be an int"):
        compact_rows_(x, torch.ones(2, 3, dtype=torch.bool), fill=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,fill", [("keys", 0), ("odd", 0), ("valid", 0), ("pos", -1)])
def test_kernel_matches_reference_on_gpu(kind, fill):
    g = torch.Generator().manual_seed(7)
    x = buffer_tensor(kind, 16, 128, g).cuda()
    keep = (torch.rand(16, 128, generator=g) < 0.7).cuda()
    assert torch.equal(compact_rows_(x.clone(), keep, fill), compact_rows_torch(x.clone(), keep, fill))
