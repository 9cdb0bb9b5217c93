"""KV heads split over tensor-parallel ranks, and the reductions that must span them.

Under tensor parallelism each rank's attention sees only its own KV heads, so a rank's
cache stores those heads alone. Everything that stays within a head (quantization, a
head's attention, its redundancy) runs locally as usual. A decision that combines heads,
one keep set per (row, layer) from scores averaged over heads, a thought class from the
sparsity of all heads, K-means over a token's keys of every head, a block distance
for sharing, would differ from rank to rank if each used only its own heads, and the
ranks would then keep different tokens. :class:`HeadShards` gives those decisions the
sum, mean or max over the heads of every rank, by an all-reduce over the
tensor-parallel group (NCCL on GPUs, gloo on CPU); without tensor parallelism
(:data:`LOCAL`) each reduction is the plain local one.
"""

from __future__ import annotations

import torch


class HeadShards:
    """The tensor-parallel group whose ranks hold the other KV heads of every layer."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    @property
    def sharded(self) -> bool:
        """Whether other ranks hold heads of the same layers."""
        return self.size > 1

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (every rank gets the same bits)."""
        return self._all_reduce(x, "SUM")

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the ranks, in place."""
        return self._all_reduce(x, "MAX")

    def all_sum_values(self, values: list[float]) -> list[float]:
        """Host numbers summed over the ranks (one small collective on the group's device)."""
        if not self.sharded:
            return list(values)
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        return self.all_sum(torch.tensor(values, dtype=torch.float64, device=device)).tolist()

    def sum(self, per_head: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Sum over the heads of dim ``dim`` on every rank."""
        return self.all_sum(per_head.sum(dim=dim))

    def mean(self, per_head: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Mean over the heads of dim ``dim`` on every rank (each rank holds as many)."""
        return self.sum(per_head, dim) / (per_head.shape[dim] * self.size)

    def amax(self, per_head: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Maximum over the heads of dim ``dim`` on every rank."""
        return self.all_max(per_head.amax(dim=dim))

    def total(self, local_heads: int) -> int:
        """KV heads of a layer over all ranks."""
        return local_heads * self.size

    def _all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self.sharded:
            return x
        import torch.distributed as dist

        if not x.is_contiguous():
            raise ValueError(f"an all-reduce over KV heads needs a contiguous tensor, got strides {x.stride()}")
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=self.group)
        return x

    def __deepcopy__(self, memo) -> "HeadShards":
        return self  # a copied cache (a prompt's, reused) talks to the same ranks

    def __repr__(self) -> str:
        return f"HeadShards(size={self.size}, rank={self.rank})"


#: No tensor parallelism: every head of a layer is on this process.
LOCAL = HeadShards()


def check_heads_split(config, size: int, owner: str) -> None:
    """Refuse a model whose attention or KV heads do not split evenly over ``size`` ranks
    (replicated KV heads are not supported), naming the counts."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % size or config.num_attention_heads % size:
        raise ValueError(f"{owner}: {config.num_attention_heads} attention heads and {kv_heads} KV heads cannot be "
                         f"split over {size} tensor-parallel ranks; accepted: a rank count that divides both")


def head_shards_of(model) -> HeadShards:
    """The tensor-parallel group of a model that transformers loaded with a tensor-parallel plan
    (``from_pretrained(..., tp_plan="auto")`` or its ``distributed_config``), else :data:`LOCAL`."""
    size = getattr(model, "_tp_size", None) or 1
    if size <= 1:
        return LOCAL
    check_heads_split(model.config.get_text_config(), size, "the model")
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError(f"the model reports tensor-parallel size {size} but no device mesh; load it with "
                         "transformers' tensor-parallel plan (tp_plan='auto') under torchrun")
    names = mesh.mesh_dim_names or ()
    tp_mesh = mesh["tp"] if mesh.ndim > 1 and "tp" in names else mesh
    if tp_mesh.ndim != 1:
        raise ValueError(f"cannot find the tensor-parallel dimension of the device mesh {mesh} (dims {names}); "
                         "accepted: a 1-D mesh or one with a 'tp' dimension")
    shards = HeadShards(tp_mesh.get_group())
    if shards.size != size:
        raise ValueError(f"the model's tensor-parallel size is {size} but its mesh group has {shards.size} ranks")
    return shards

