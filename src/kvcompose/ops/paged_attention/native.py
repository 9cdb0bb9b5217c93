"""The CUDA decode kernel of NVFP4, ternary, INT4, INT2 and KIVI pools (``native_packed.cu``), built on
first use, and when it runs.

The Triton partial kernel decodes every format; for NVFP4 keys and values it spends most of
its instructions moving decoded values into the tensor cores' operand layout, and reads
memory at a third of copy bandwidth. The CUDA kernel stages each tile's codes in shared
memory and reads each thread's mma fragment straight from them (see the notes at the top of
the ``.cu`` file). Ternary pools (ThinKV's T class) share its code path: both formats carry an
E4M3 scale per 16 channels, and only the decoding of a code word differs. INT4 and INT2 pools in
groups of 32 channels with fp16 scales (the ``int`` quantizer's ``group_size=32``, what ``thinkv-int``
keeps) take it too: a code becomes ``code x scale + minimum`` in fp16 by one mask-OR, a subtraction
and a fused multiply-add per pair of values. KIVI pools (the ``kivi2`` and ``kivi4`` presets: keys per
channel over token groups of 32, values per token over the whole head) take it with their key scales
folded into the queries once per tile. It writes partial
results in the Triton merge kernel's layout, so the two kernels share one merge.

It is built with ``torch.utils.cpp_extension.load_inline`` the first time a step could use
it (about a minute, cached by torch afterwards), and only where it can run: a CUDA GPU of
compute capability 8.9 or later (its E4M3 conversion), ``nvcc`` on the machine, and
``KVCOMPOSE_NATIVE_ATTENTION`` not set to ``0``. Nothing is compiled at install time. Where
it cannot be built the Triton kernel runs, and :func:`native_status` says why; the first
choice is logged on the ``kvcompose`` logger.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from ...device_constants import device_constant
from .formats import PagedSource, row_layout

log = logging.getLogger("kvcompose")

#: ``KVCOMPOSE_NATIVE_ATTENTION=0`` keeps every step on the Triton kernel.
ENABLED = os.environ.get("KVCOMPOSE_NATIVE_ATTENTION", "1") != "0"
#: Formats the CUDA kernel decodes (:func:`kernel_format` names a source's),
#: its ``fmt`` codes, and the head dims each is compiled for (a thread reads a whole code word of
#: every value row: 16 ternary or INT2 codes are 16 channels, an eighth of 128).
FORMATS = {"nvfp4": 0, "ternary": 1, "int4": 2, "int2": 3, "kivi4": 4, "kivi2": 5}
FORMAT_HEAD_DIMS = {"nvfp4": (64, 128), "ternary": (128,), "int4": (64, 128), "int2": (128,), "kivi4": (64, 128),
                    "kivi2": (128,)}
INT_GROUP = 32  # channels per fp16 scale and minimum of the INT formats the kernel reads
KIVI_TOKEN_GROUP = 32  # tokens per KIVI key scale: one tile of the kernel
#: The pools it reads, in words (the log line, :func:`kvcompose.speed.attention_kernels`).
POOLS = "NVFP4, ternary, INT4, INT2 and KIVI pools"
#: Head dims where ``backend=None`` picks the CUDA kernel: measured on an H200
#: (``benchmarks/results/attention_gpu.json``, head-major pools, 2026-11-29T05:21:35), it beat the
#: Triton kernel at 128 (1.20-1.78x on NVFP4, 1.16-1.40x on ternary, 1.29-2.28x on INT4 and
#: 1.35-1.92x on INT2 pools, 1.37-1.49x on ThinKV's store and 1.45-1.79x on thinkv-int's) and at 64
#: on NVFP4 (1.18x at 16 x 8K) and INT4 pools (1.50x, 2026-11-29T06:00:12), and tied it there on
#: ThinKV's store (1.03x; its ternary pool stays in Triton). On KIVI pools (2026-11-29T07:49:24,
#: 1 x 32K to 256 x 1K): 1.42-2.58x on KIVI-2 and 1.34-2.03x on KIVI-4 at 128, 3.86x on KIVI-4 at 64.
AUTO_HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads per KV head: the mma's 8 columns
SOURCE = Path(__file__).with_name("native_packed.cu")
_STATE: dict = {}  # device index -> (module or None, reason)


def kernel_format(src: PagedSource) -> str | None:
    """The kernel's name of a source's format (:data:`FORMATS`), or None where it does not read it:
    ``nvfp4`` and ``ternary`` keys and values; ``int4`` / ``int2`` for INT keys and values grouped per
    token in groups of ``INT_GROUP`` channels; ``kivi4`` / ``kivi2`` for KIVI keys (per channel over
    ``KIVI_TOKEN_GROUP`` tokens) with INT values grouped per token over the whole head. INT scales and
    minimums in fp16."""
    key, value = src.key, src.value
    if key.fmt == value.fmt and key.fmt in ("nvfp4", "ternary"):
        return key.fmt
    if key.bits != value.bits or not _int_per_token(value, INT_GROUP if key.fmt == "int" else value.head_dim()):
        return None
    if key.fmt == "int" and _int_per_token(key, INT_GROUP):
        return f"int{key.bits}"
    if key.fmt == "int_channel" and key.token_group == KIVI_TOKEN_GROUP and _fp16_pair(key) \
            and key.scale.shape[1:] == (key.codes.shape[1], key.head_dim()) and key.scale.is_contiguous() \
            and key.minimum.is_contiguous():
        return f"kivi{key.bits}"
    return None


def _fp16_pair(op) -> bool:
    return op.minimum is not None and op.scale.dtype == op.minimum.dtype == torch.float16 \
        and op.scale.shape == op.minimum.shape


def _int_per_token(op, group: int) -> bool:
    """INT-2 or INT-4 with an fp16 scale and minimum per ``group`` channels of a token."""
    return op.fmt == "int" and op.bits in (2, 4) and _fp16_pair(op) and op.scale.shape[-1] * group == op.head_dim()


def fits(query: torch.Tensor, src: PagedSource) -> bool:
    """Whether the CUDA kernel takes this source and query: a format it reads (:func:`kernel_format`) at
    a head dim it is compiled for (NVFP4, INT4 and KIVI-4: 64 and 128; ternary, INT2 and KIVI-2: 128), a
    bf16 or fp16 query, at most ``MAX_GROUP`` query heads per KV head; KIVI pools also in blocks of a
    multiple of 32 slots with the value scales of consecutive slots adjacent (head-major rows, the
    default), so that a tile's scales are one copy each."""
    H = src.key.codes.shape[1]
    fmt = kernel_format(src)
    return (fmt is not None and query.shape[-1] in FORMAT_HEAD_DIMS[fmt]
            and query.dtype in (torch.bfloat16, torch.float16) and query.shape[1] // H <= MAX_GROUP
            and src.table.dtype == torch.int64 and _addressable(src)
            and src.block_size >= 4 and src.block_size & (src.block_size - 1) == 0  # the kernel shifts by it
            and src.valid.data_ptr() % 4 == 0  # validity is copied four slots at once
            and max(src.key.codes.numel(), src.value.codes.numel()) < 2 ** 32  # the kernel's 32-bit offsets
            and all(t.data_ptr() % 16 == 0 for op in (src.key, src.value) for t in _pool_tensors(op))
            and (not fmt.startswith("kivi") or _kivi_tiles(src)))


def _kivi_tiles(src: PagedSource) -> bool:
    """A KIVI source whose every 32-token tile is one token group of one block, with its value scales and
    minimums one 16-byte-aligned run of bytes each (head-major over a multiple of 8 slots), and a key scale
    row for every token group of the pool."""
    rows, heads = row_layout(src), src.key.codes.shape[1]
    return (src.block_size % KIVI_TOKEN_GROUP == 0 and (rows > 0 or heads == 1) and rows % 8 == 0
            and src.key.scale.shape[0] * KIVI_TOKEN_GROUP >= src.valid.numel())  # minimums: the scales' shape


def _pool_tensors(op) -> list[torch.Tensor]:
    """The tensors of an operand the kernel copies: codes, scales, and the INT formats' minimums (KIVI keys'
    scales and minimums: per token group)."""
    return [op.codes, op.scale] + ([op.minimum] if op.fmt.startswith("int") else [])


def _addressable(src: PagedSource) -> bool:
    """Codes and scales slot-major or head-major (:func:`~kvcompose.ops.paged_attention.formats.row_layout`)."""
    try:
        row_layout(src)
    except ValueError:
        return False
    return True


def module(device: torch.device):
    """The built extension for ``device``, or None where it cannot run there (see :func:`native_status`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STATE:
        _STATE[index] = _build(index)
        built, reason = _STATE[index]
        kernel = "Triton" if built is None else "CUDA"
        log.info("kvcompose: decode attention of %s runs the %s kernel (%s)", POOLS, kernel, reason)
    return _STATE[index][0]


def native_status(device: torch.device | None = None) -> dict:
    """Which kernel decodes the pools it reads (:data:`POOLS`) on ``device`` and why: ``{"kernel": "cuda" | "triton",
    "reason": ...}``. Builds the extension if it was not tried yet."""
    if device is None or device.type != "cuda":
        if not torch.cuda.is_available():
            return {"kernel": "triton", "reason": "no CUDA device"}
        device = torch.device("cuda", torch.cuda.current_device())
    built = module(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"kernel": "triton" if built is None else "cuda", "reason": _STATE[index][1]}


def _build(index: int):
    if not ENABLED:
        return None, "KVCOMPOSE_NATIVE_ATTENTION=0"
    if torch.version.hip:
        return None, "ROCm build of torch"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return None, f"compute capability {major}.{minor} lacks the E4M3 conversion (needs 8.9 or later)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return None, "nvcc not found (set CUDA_HOME to build the CUDA kernel)"
    arch = f"{major}{minor}"
    try:
        built = cpp_extension.load_inline(
            name=f"kvcompose_native_packed_sm{arch}",
            cpp_sources=_DECLARATIONS,
            cuda_sources=SOURCE.read_text(),
            functions=["packed_partial", "packed_resident"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a toolkit that does not match torch's
        return None, f"building {SOURCE.name} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    return built, f"{SOURCE.name} built for sm_{arch}"


_DECLARATIONS = """
void packed_partial(at::Tensor q, at::Tensor part, at::Tensor lse, std::vector<at::Tensor> tables, at::Tensor valid,
                    at::Tensor kc, at::Tensor ks, at::Tensor khs, at::Tensor vc, at::Tensor vs, at::Tensor vhs,
                    at::Tensor km, at::Tensor vm, std::vector<at::Tensor> extents, int64_t block_size,
                    std::vector<int64_t> per_split, std::vector<int64_t> n_splits, std::vector<int64_t> first,
                    int64_t total, double qk_scale, int64_t fmt, int64_t head_rows);
int64_t packed_resident(int64_t D, bool bf16, int64_t fmt);
"""
#: Regions one launch reads at most (``MAX_REGIONS`` of the ``.cu`` file).
MAX_REGIONS = 4


@functools.lru_cache(maxsize=64)
def resident_programs(device_index: int, head_dim: int, bf16: bool, fmt: str = "nvfp4") -> int:
    """Programs (one warp each) of the CUDA kernel for ``fmt`` pools that one SM holds at once."""
    return max(1, int(_STATE[device_index][0].packed_resident(head_dim, bf16, FORMATS[fmt])))


def pool_of(src: PagedSource) -> tuple:
    """What sources must share to be read by one launch: their pool's tensors (codes, scales,
    minimums, second-level scales, validity) and block size. Regions of one pool differ only in
    their block tables and extents."""
    key, value = src.key, src.value
    tensors = (src.valid, key.codes, key.scale, key.minimum, key.head_scale, value.codes, value.scale, value.minimum,
               value.head_scale)
    return tuple(None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
                 for t in tensors) + (src.block_size, kernel_format(src))


def launch_partial(built, q: torch.Tensor, regions: list[tuple[PagedSource, int, int, int]], part: torch.Tensor,
                   lse: torch.Tensor, total: int, qk_scale: float) -> None:
    """One launch over ``regions`` of one pool (:func:`pool_of`), each given as ``(source, first
    partial result, tokens per split, splits)``: its splits run as programs per (row, KV head),
    written as partial results ``first ..`` of ``total`` (the Triton merge's layout)."""
    sources, firsts, per_split, n_splits = zip(*regions)
    src = sources[0]
    key, value = src.key, src.value
    fmt = kernel_format(src)
    no_extent = device_constant((), q.device, torch.int64)  # empty: the kernel bounds that region by its table
    none, no_scale = (device_constant((), q.device, t) for t in (torch.uint8, torch.float32))  # what it lacks
    integer = fmt.startswith(("int", "kivi"))  # fp16 scales and minimums, read as bytes; no second-level scales

    def scales(op) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if integer:
            return op.scale.view(torch.uint8), no_scale, op.minimum.view(torch.uint8)
        return op.scale, op.head_scale.float().contiguous(), none

    (ks, khs, km), (vs, vhs, vm) = scales(key), scales(value)
    built.packed_partial(q, part, lse, [s.table.contiguous() for s in sources], src.valid.view(torch.uint8),
                        key.codes, ks, khs, value.codes, vs, vhs, km, vm,
                        [s.extent if s.extent is not None else no_extent for s in sources],
                        src.block_size, list(per_split), list(n_splits), list(firsts), total, qk_scale,
                        FORMATS[fmt], row_layout(src))
