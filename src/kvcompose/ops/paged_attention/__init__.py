"""Decode attention that reads the paged store in place, every storage format decoded in registers.

One decode step has one query per row (``[B, Hq, 1, D]``). The kept tokens of a layer
live in *sources* (:class:`PagedSource`): pools of blocks in one storage format each,
plus the dense recent buffer. :func:`paged_decode_attention` runs one launch of a split-KV
partial kernel over all sources, then one merge by log-sum-exp; evictors that accumulate
attention every step (``h2o``) pass ``mass`` and get it added per slot on the device.
:func:`paged_decode_attention_torch` is the plain-torch reference.

Modules:

- :mod:`.formats`: the storage formats, the types :class:`KVOperand`, :class:`PagedSource`, and the two
  row layouts a source's per-slot tensors may have (:func:`row_layout`);
- :mod:`.reference`: the plain-torch reference;
- :mod:`.decode`: the per-format decode of a tile in Triton (inline PTX for the exact formats);
- :mod:`.kernels`: the partial, merge and attention-mass kernels;
- :mod:`.launch`: launch planning (tile shape, split-KV plan, resident programs) and the launches;
- :mod:`.native`: the CUDA kernel of NVFP4, ternary, INT4, INT2 and KIVI pools (``native_packed.cu``), built on first
  use where it can run;
- :mod:`.cost`: the bytes one step must read;
- :mod:`.attention`: the entry point, its input checks and the choice of kernel or reference.
"""

from .attention import paged_decode_attention
from .cost import bytes_read
from .formats import EXACT_FORMATS, FORMATS, KVOperand, PagedSource, head_major, row_layout
from .reference import add_mass_torch, decode_operand_torch, dense_source_view, paged_decode_attention_torch

__all__ = [
    "EXACT_FORMATS", "FORMATS", "KVOperand", "PagedSource", "add_mass_torch", "bytes_read", "decode_operand_torch",
    "dense_source_view", "head_major", "paged_decode_attention", "paged_decode_attention_torch", "row_layout",
]
