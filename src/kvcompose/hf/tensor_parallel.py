"""Loading a checkpoint tensor-parallel, for kvcompose caches under ``torchrun``.

transformers does the sharding (its tensor-parallel plan over ``torch.distributed``):
every rank holds a slice of the attention heads and of the MLP, and the model's
forward all-reduces where the plan says. A kvcompose cache made for such a model
(:meth:`Policy.make_cache`) finds the tensor-parallel group on the model, stores
only the rank's KV heads, and reduces every decision that combines heads over the
group (:mod:`kvcompose.distributed`), so all ranks keep the same tokens.
"""

from __future__ import annotations

import atexit
import os

import torch

from ..distributed import check_heads_split


def load_tensor_parallel(path: str, dtype: torch.dtype | str | None = None, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path)`` sharded over the ranks ``torchrun`` started.

    Call it on every rank (``torchrun --nproc-per-node N script.py``). The process group is
    started if it is not yet (NCCL on GPUs, gloo on CPU), and each rank works on GPU
    ``LOCAL_RANK``; one rank loads the model whole, so a script runs the same at every
    size. The KV heads must divide by the number of ranks. ``kwargs`` go to
    ``from_pretrained``. Returns the model, set to the kvcompose attention.
    """
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise ValueError("load_tensor_parallel needs the environment torchrun sets (WORLD_SIZE); run the script "
                         "with `torchrun --nproc-per-node N script.py`")
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in ("revision",)})
    check_heads_split(config.get_text_config(), world, path)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(_close_group)
    if world == 1:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device}, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"),
                                                     **kwargs)
    model.eval()
    model.set_attn_implementation("kvcompose")
    return model


def _close_group() -> None:
    """Close the group this module started before the interpreter tears down.

    Left to interpreter shutdown, gloo's worker threads can be destroyed while still
    joinable, and the rank then aborts after its work is done ("terminate called without
    an active exception"), failing the whole ``torchrun``.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
