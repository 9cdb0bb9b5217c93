"""How the paged decode attention is launched: tile shape, split-KV plan, resident programs, the launches.

The partial kernel runs one program per (row, KV head, split). Its speed depends on how
many programs an SM holds at once and on the last wave of the grid, so the launcher asks
three questions, answered here without touching the kernel: which tile shape
(``TILE_SHAPE``), how many programs of a compiled variant fit on one SM
(:func:`resident_programs`), and how many splits per row (:func:`plan_splits`).
:func:`_plan_launch` assigns the sources' splits to the programs of the one partial
launch, and :func:`paged_decode_triton` runs the partial, merge and mass kernels.
The module constants are read at every call, so a sweep may set them.
"""

from __future__ import annotations

import functools

import torch

from ...device_constants import device_constant
from ..layout import OUT_KINDS, out_buffer
from ..triton_shim import cdiv, interpreted, next_pow2
from .formats import EXACT_FORMATS, FORMATS, KVOperand, PagedSource, row_layout
from . import native as native_kernel
from .kernels import SOURCE_CONSTS, _mass_kernel, _merge_kernel, _paged_partial_kernel, _rider_merge_kernel


# Launch shape of the partial kernel: (tokens per tile, warps). One warp on 32-token tiles keeps
# 9-12 programs resident per SM (registers bound them: 170-240 per thread). Swept on an H200
# (benchmarks/sweep_attention_gpu.py): fastest in every format at 16 x 8K, 64 x 4K
# and 256 x 1K, and at 1 x 32K too once the recent buffer shares the pool's launch (3-18% under
# two warps on 64-token tiles, which an earlier H100 sweep had picked for few rows). Two or
# four warps per program hold nearly as many registers per thread and halve the programs per SM.
TILE_SHAPE = (32, 1)
TOKENS_PER_SPLIT_MIN = 256  # a split never holds fewer tokens than this (unless the row is shorter)
PROGRAMS_PER_SM = 4  # resident programs assumed where the compiled kernel does not say
WAVE_TOLERANCE = 1.05  # a plan this close to the cheapest counts as cheapest (fewer splits win)
SMALL_SOURCE_TOKENS = 64  # sources with at most this many columns per row: light tile, ride on another's program
SMALL_TILE = 16  # tokens per tile of those
SMALL_STAGES = 1  # and their software-pipelining depth
MASS_BLOCK = 128  # tokens per program of the attention-mass kernel
MERGE_CHUNK = 16  # partial results the merge combines per step
MERGE_ROWS = 256  # below this many (row, query head) pairs the merge slices the channels:
MERGE_SLICE = 32  # this many per program. H200, 1 x 32K (32 pairs of 128 splits): 6-10% off the
MERGE_WARPS = 1  # whole op; 64 x 4K: 1-2% slower sliced, so large batches merge whole rows.
WARPS = 2  # of the attention-mass kernel (the merge's: MERGE_WARPS)
STAGES = 3  # software-pipelining depth of the partial kernel's loads (Triton's default)
MAX_REGISTERS = None  # registers per thread of the partial kernel (None: the compiler's choice)
# Where the short sources (the recent buffer) run when the long ones are not in the Triton
# partial launch: "native" (default), computed by the merge launch when the CUDA kernel read the
# long ones, so the buffer costs no launch of its own; "always" also beside long Triton sources
# (CPU tests exercise the kernel that way); "never" (each in a partial launch).
RIDERS_IN_MERGE = "native"
# ... and "native" only up to this many query heads per launch (rows x query heads): the merge
# launch's programs each compute their group's buffer before merging, which at large batches
# costs more than a partial launch of the buffer's own and a plain merge.
RIDER_MERGE_MAX_HEADS = 2048
RIDER_MERGE_CONSTS = ("CONSTS", "NSRC", "H", "G", "GP", "D", "PREC", "OUT", "NATIVE")
LOG2E = 1.4426950408889634
NATIVE_TILE = 32  # tokens per loop step of the CUDA kernel (native_packed.cu)


def plan_splits(rows: int, tokens: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM,
                block: int = TILE_SHAPE[0]) -> int:
    """Splits per row for ``rows`` (row, KV head) programs over ``tokens`` columns, tiles of
    ``block`` tokens, ``per_sm`` programs resident per SM (see :func:`fewest_waves`); each
    split holds at least ``TOKENS_PER_SPLIT_MIN`` tokens."""
    if tokens == 0:
        return 0
    most = cdiv(tokens, TOKENS_PER_SPLIT_MIN)
    if device.type != "cuda":
        return min(2, most)  # the interpreter: exercise the merge without slowing tests down
    slots = max(1, per_sm) * torch.cuda.get_device_properties(device).multi_processor_count
    return fewest_waves(max(rows, 1), tokens, slots, most, block)


@functools.lru_cache(maxsize=4096)
def fewest_waves(rows: int, tokens: int, slots: int, most: int, block: int) -> int:
    """The split count in ``1..most`` for ``rows`` programs per split with ``slots`` resident at once.

    Programs of one launch are latency-bound and take about the same time, so a launch costs
    its waves (``ceil(programs / slots)``) times the tiles of one split. Among the plans within
    ``WAVE_TOLERANCE`` of the cheapest, the fewest splits (fewer partial results to merge, no
    many-wave plan for a rounding gain). A 1.2-wave grid costs two waves: rounding the split
    count up to "fill the GPU" made 16 x 8K rows slower than 64 x 4K ones."""
    cost = {s: cdiv(rows * s, slots) * cdiv(cdiv(tokens, s), block) for s in range(1, most + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * WAVE_TOLERANCE)


def resident_programs(kernel, device: torch.device) -> int:
    """Programs of a compiled kernel that one SM holds at once (registers, shared memory and
    threads permitting); ``PROGRAMS_PER_SM`` where the compiled kernel does not say."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()  # loads the binary, which sets n_regs
    regs, warps = getattr(kernel, "n_regs", None), getattr(getattr(kernel, "metadata", None), "num_warps", None)
    if not regs or not warps:
        return PROGRAMS_PER_SM
    props = torch.cuda.get_device_properties(device)
    per_warp = cdiv(regs * 32, 256) * 256  # registers are handed out per warp in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    shared = kernel.metadata.shared + 1024  # the runtime reserves 1 KiB per block
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads, 32))


def kernel_fits(query: torch.Tensor, sources: list[PagedSource]) -> bool:
    """Whether the compiled kernel takes this head dim: a power of two, at least 16 channels per
    code position of a byte (the tensor-core dot needs K >= 16). Elsewhere the reference runs."""
    D = query.shape[-1]
    per = max([1] + [op.per_byte for s in sources for op in (s.key, s.value)])
    return D == next_pow2(D) and D // per >= 16


def paged_decode_triton(query, sources, scaling, probs, mass=None, native: str = "auto"):
    """:func:`~kvcompose.ops.paged_attention.paged_decode_attention` through the kernels (inputs checked):
    one partial launch for all sources, one merge, and one mass launch per source with ``mass``.
    Each source the CUDA kernel takes (:mod:`.native`; ``native``: see :func:`_native_plans`)
    gets a launch of its own instead, where that kernel is built; both write into the one merge."""
    B, Hq, _, D = query.shape
    if not interpreted(_paged_partial_kernel) and not kernel_fits(query, sources):
        raise ValueError(f"the paged attention kernel needs a power-of-two head dim with >= 16 channels per code "
                         f"position of a packed byte; got head dim {D} (use backend='torch' or None)")
    q = query.contiguous()
    device = q.device
    if mass is not None:  # sources without columns receive nothing
        mass = ([c for c, s in zip(mass[0], sources) if s.tokens > 0], mass[1])
    sources = [s for s in sources if s.tokens > 0]
    if not sources:  # nothing stored anywhere: every row attends to nothing
        out = torch.zeros_like(query)
        return (out, torch.zeros(B, Hq, 0, device=device)) if probs else out
    H = sources[0].key.codes.shape[1]
    cols = sum(s.tokens for s in sources)
    scores = probs or mass is not None
    built, native_plans, first = _native_plans(q, sources, scores, native)
    rest = [s for i, s in enumerate(sources) if i not in native_plans]
    in_merge = merge_riders(rest, first, scores, B * Hq) if merge_width(B * Hq, D, device) == next_pow2(D) else []
    riders = [s for i, s in enumerate(rest) if i in in_merge]
    rest = [s for i, s in enumerate(rest) if i not in in_merge]
    if rest:
        args, consts = _partial_launch(q, rest, scores)
        programs, tuples, kwargs, count = _plan_launch(q, rest, args, consts, cols, first)
    total = first + (count if rest else 0) + len(riders)
    part = torch.empty(B, Hq, total, D, dtype=torch.float32, device=device)
    lse = torch.empty(B, Hq, total, dtype=torch.float32, device=device)  # every split writes its own
    logits = torch.empty(B, Hq, cols if scores else 1, device=device)  # the splits cover every column
    for group in native_groups(native_plans, sources):
        native_kernel.launch_partial(built, q, group, part, lse, total, scaling * LOG2E)
    if rest:
        _paged_partial_kernel[(B * H, programs)](q, part, lse, logits, total, cols, scaling * LOG2E, tuples, **kwargs)
    out, dst, kind = out_buffer((B, Hq, 1, D), query.dtype, device)
    final = torch.empty(B, Hq, dtype=torch.float32, device=device)
    if riders:
        args, consts = _partial_launch(q, riders, False)
        no_extent = device_constant((0,), device, torch.int64)  # never read (EXTENT off)
        tuples = tuple(a + (src.tokens, 0, 1, total - len(riders) + i, 0,
                            no_extent if src.extent is None else src.extent)
                       for i, (a, src) in enumerate(zip(args, riders)))
        _rider_merge_kernel[(B * H, Hq // H)](q, part, lse, dst, final, total, scaling * LOG2E, tuples,
                                      SP=next_pow2(total), CHUNK=MERGE_CHUNK, num_warps=TILE_SHAPE[1],
                                      **{k: consts[k] for k in RIDER_MERGE_CONSTS})
    else:
        width = merge_width(B * Hq, D, device)
        _merge_kernel[(B * Hq, cdiv(D, width))](part, lse, dst, final, total, D=D, SP=next_pow2(total), DP=width,
                                                OUT=kind, CHUNK=MERGE_CHUNK, num_warps=MERGE_WARPS)
    if mass is not None:
        weight = mass[1].float().contiguous()
        col0 = 0
        for src, channel in zip(sources, mass[0]):
            table = src.table.contiguous()
            _mass_kernel[(B, cdiv(src.tokens, MASS_BLOCK))](
                logits, final, table, src.valid.view(torch.uint8), channel, weight, table.shape[1], src.tokens,
                col0, cols, HQ=Hq, HP=next_pow2(Hq), BS=src.block_size, BLOCK=MASS_BLOCK, num_warps=WARPS)
            col0 += src.tokens
    if not probs:
        return out
    return out, torch.exp2(logits - final[..., None]).nan_to_num(0.0)  # -inf - -inf (empty row) -> 0


def _native_plans(q: torch.Tensor, sources: list[PagedSource], scores: bool, native: str) -> tuple:
    """The sources the CUDA kernel runs (none where scores are written, it has no built module
    or does not take them; ``native="auto"``: only at the head dims where it is the faster,
    ``"cuda"``: wherever it takes the source, ``"off"``: none): ``(module, {source index:
    (first partial result, tokens per split, splits)}, partial results they take)``."""
    if native == "off" or scores or not q.is_cuda:
        return None, {}, 0
    if native == "auto" and q.shape[-1] not in native_kernel.AUTO_HEAD_DIMS:
        return None, {}, 0
    take = [i for i, s in enumerate(sources) if native_kernel.fits(q, s) and not small_source(s)]
    built = native_kernel.module(q.device) if take else None
    if built is None:
        return None, {}, 0
    B, H = q.shape[0], sources[0].key.codes.shape[1]
    plans, first = {}, 0
    for i in take:
        per_sm = native_kernel.resident_programs(q.device.index or 0, q.shape[-1], q.dtype == torch.bfloat16,
                                                 native_kernel.kernel_format(sources[i]))
        tokens = sources[i].tokens
        n = plan_splits(B * H, tokens, q.device, per_sm, NATIVE_TILE)
        per = cdiv(cdiv(tokens, n), NATIVE_TILE) * NATIVE_TILE
        n = cdiv(tokens, per)
        plans[i] = (first, per, n)
        first += n
    return built, plans, first


def native_groups(plans: dict, sources: list[PagedSource]) -> list[list[tuple]]:
    """The CUDA kernel's launches: the planned sources of one pool together (at most
    ``MAX_REGIONS`` each), as ``(source, first partial result, tokens per split, splits)``."""
    groups: dict[tuple, list[list[tuple]]] = {}
    for i, (first, per, n) in plans.items():
        launches = groups.setdefault(native_kernel.pool_of(sources[i]), [[]])
        if len(launches[-1]) == native_kernel.MAX_REGIONS:
            launches.append([])
        launches[-1].append((sources[i], first, per, n))
    return [launch for launches in groups.values() for launch in launches]


def _plan_launch(q: torch.Tensor, sources: list[PagedSource], args: list[tuple], consts: dict,
                 cols: int, first: int = 0) -> tuple[int, tuple, dict, int]:
    """Which programs of the one partial launch run which source's splits.

    The long sources own programs, each split over as many as :func:`plan_splits` finds
    best for the launch's resident programs per SM; short ones (the recent buffer) ride on
    the last program of the longest, as one split, adding no program and no wave. A shared
    launch is held to the registers its longest source needs alone (measured on an H200,
    the buffer's branch otherwise raised them by 10-35 per thread, costing the pool one or
    two resident programs per SM). Returns the programs per (row, KV head), each source's
    runtime tuple (``SOURCE_FIELDS``), the launch's keyword arguments and the number of
    partial results."""
    B, H = q.shape[0], sources[0].key.codes.shape[1]
    riders = [i for i, s in enumerate(sources) if small_source(s)] if len(sources) > 1 else []
    owners = [i for i in range(len(sources)) if i not in riders] or riders[:1]
    riders = [i for i in riders if i not in owners]
    host = max(owners, key=lambda i: sources[i].tokens)
    kwargs = dict(consts)
    if len(sources) > 1 and MAX_REGISTERS is None and q.is_cuda:
        kwargs["maxnreg"] = _registers(q, ([args[host]], dict(consts, CONSTS=(consts["CONSTS"][host],), NSRC=1)), cols)
    per_sm = _resident(q, (args, kwargs), cols)
    block_at = SOURCE_CONSTS.index("BLOCK")
    fields, programs, partials = {}, 0, first
    for i in owners + riders:
        block = consts["CONSTS"][i][block_at]
        n = plan_splits(B * H, sources[i].tokens, q.device, per_sm, block) if i in owners else 1
        per = cdiv(cdiv(sources[i].tokens, n), block) * block  # whole tiles; rounding up can empty the last
        n = cdiv(sources[i].tokens, per)  # splits: drop those
        if i in owners:
            fields[i] = (per, programs, n, partials)
            programs += n
        else:
            fields[i] = (per, fields[host][1] + fields[host][2] - 1, 1, partials)
        partials += n
    first_cols = [sum(s.tokens for s in sources[:i]) for i in range(len(sources))]
    no_extent = device_constant((0,), q.device, torch.int64)  # never read (EXTENT off)
    extents = [no_extent if s.extent is None else s.extent for s in sources]
    tuples = tuple(args[i] + fields[i] + (first_cols[i], extents[i]) for i in range(len(sources)))
    return programs, tuples, kwargs, max(1, partials - first)


def query_rows(group: int, dense: bool) -> int:
    """Rows of the partial kernel's query tile for a GQA group: the group rounded up to a power
    of two, which Triton pads to the tensor cores' 16 rows itself; 16 rows of our own where
    the launch's longest source is ``dense`` (more where the group is larger: every query head
    of the group must have a row). Measured on an H200 (G = 4, one launch with the buffer):
    the group's 4 rows made fp8, nvfp4, ternary and KIVI-2 3-13% faster (less shared memory
    and fewer registers, more programs per SM), int4 within 3%, and dense bf16 3-4% slower."""
    return max(16, next_pow2(group)) if dense else next_pow2(group)


def merge_width(pairs: int, D: int, device: torch.device) -> int:
    """Output channels per merge program: all of a row's, or ``MERGE_SLICE`` of them where
    fewer than ``MERGE_ROWS`` (row, head) pairs would leave most of a GPU idle (batch 1, long
    rows). The CPU interpreter pays for every program and has no SMs to fill: whole rows."""
    whole = next_pow2(D)
    if pairs >= MERGE_ROWS or device.type != "cuda":
        return whole
    return min(whole, MERGE_SLICE)


def merge_riders(rest: list[PagedSource], native_partials: int, scores: bool, query_heads: int = 0) -> list[int]:
    """Indices of the short sources in ``rest`` (the sources the Triton partial kernel would
    run) that :func:`~.kernels._rider_merge_kernel` computes in the merge launch instead: the
    recent buffer beside pools the CUDA kernel read, which would otherwise need a partial
    launch of its own (``RIDERS_IN_MERGE``: ``"native"``, up to ``RIDER_MERGE_MAX_HEADS``
    ``query_heads`` per launch; ``"always"`` at any size and also where long sources stay in
    the Triton launch; ``"never"``). Not when scores are written, and not
    where the merge slices channels (few rows, many splits: a program per query head walking
    every split of whole rows would idle the GPU; :func:`paged_decode_triton` checks that).

    Where long sources stay in the Triton launch (an FP8 pool beside CUDA-read ones, or a
    ternary pool at head dim 64), the buffer rides on their programs instead: in the merge it
    made the benchmark's mixed store (ternary, NVFP4 and FP8 pools, the ternary one then read
    by Triton) up to 16% slower on an H200 (8% at 16 x 8K, 16% at head dim 64, even at 1 x 32K
    and 256 x 1K; ``bench_attention_gpu.py --riders-in-merge``)."""
    small = [i for i, s in enumerate(rest) if small_source(s)]
    if scores or not small or RIDERS_IN_MERGE == "never":
        return []
    alone = len(small) == len(rest)  # the short sources would need a partial launch of their own
    if RIDERS_IN_MERGE == "always":
        return small if native_partials > 0 or not alone else []
    return small if native_partials > 0 and alone and query_heads <= RIDER_MERGE_MAX_HEADS else []


def small_source(src: PagedSource) -> bool:
    """Whether a source's rows are short enough (the recent buffer) for the light tile: 16
    tokens, no software pipelining. Its branch of the shared launch then never needs more
    registers or shared memory than a pool's branch."""
    return src.tokens <= SMALL_SOURCE_TOKENS


def _partial_launch(q: torch.Tensor, sources: list[PagedSource], scores: bool) -> tuple[list[tuple], dict]:
    """Per source, its runtime arguments of :func:`_paged_partial_kernel` before the split
    geometry (``SOURCE_FIELDS``); and the launch's keyword arguments, with ``CONSTS`` the
    sources' compile-time constants (``SOURCE_CONSTS``), at the launch shape ``TILE_SHAPE``
    (tokens per tile, warps). A source's ``extent`` bounds its rows' loops (``EXTENT``) unless
    the launch writes scores: those cover every column, written or not."""
    D, device = q.shape[-1], q.device
    H = sources[0].key.codes.shape[1]
    args, consts = [], []
    for src in sources:
        table = src.table.contiguous()
        kb, kg, ktg = _operand_constants(src.key, D)
        vb, vg, _ = _operand_constants(src.value, D)
        head_rows = row_layout(src)
        args.append((table, src.valid.view(torch.uint8), *_operand_args(src.key, device),
                     *_operand_args(src.value, device), table.shape[1], head_rows))
        block, stages = (SMALL_TILE, SMALL_STAGES) if small_source(src) else (TILE_SHAPE[0], STAGES)
        c = dict(KFMT=FORMATS[src.key.fmt], VFMT=FORMATS[src.value.fmt], KBITS=kb, VBITS=vb, KGROUP=kg, VGROUP=vg,
                 KTG=ktg, KPER=src.key.per_byte, VPER=src.value.per_byte, KEX=_exact(src.key, q.dtype),
                 VEX=_exact(src.value, q.dtype), KFOLD=_folds(src, block, q.dtype), BS=src.block_size,
                 BLOCK=block, STAGES=stages, EXTENT=src.extent is not None and not scores, HM=head_rows > 0)
        consts.append(tuple(c[name] for name in SOURCE_CONSTS))
    G = q.shape[1] // H
    longest = max(sources, key=lambda s: s.tokens)
    kwargs = dict(
        CONSTS=tuple(consts), NSRC=len(sources), H=H, G=G, GP=query_rows(G, longest.key.fmt == "dense"), D=D,
        SCORES=scores,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", OUT=OUT_KINDS[q.dtype],
        NATIVE=not interpreted(_paged_partial_kernel), num_warps=TILE_SHAPE[1], num_stages=STAGES,
        **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}),
    )
    return args, kwargs


_RESIDENT: dict = {}  # (device, compile-time constants) -> programs per SM of that variant


def _resident(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int) -> int:
    """Programs per SM of the variant a launch compiles to; compiled ahead of its first launch
    so that even the first call splits as every later one does."""
    if q.device.type != "cuda":
        return PROGRAMS_PER_SM
    key = (q.device.index, q.dtype, *launch[1].values())  # _partial_launch builds consts in one fixed order
    if key not in _RESIDENT:
        _RESIDENT[key] = resident_programs(compiled_partial(q, launch, cols), q.device)
    return _RESIDENT[key]


_REGISTERS: dict = {}  # (device, compile-time constants) -> registers per thread of that variant


def _registers(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int) -> int:
    """Registers per thread of the variant a launch compiles to (the cap of a shared launch:
    measured on an H200, the short source's branch otherwise raised them by 10-35, costing the
    long source one or two resident programs per SM)."""
    key = (q.device.index, q.dtype, *launch[1].values())
    if key not in _REGISTERS:
        kernel = compiled_partial(q, launch, cols)
        kernel._init_handles()
        _REGISTERS[key] = kernel.n_regs
    return _REGISTERS[key]


def compiled_partial(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int):
    """The compiled :func:`_paged_partial_kernel` of a launch (``warmup``: the launch's own
    queries, sources and columns; a typical split geometry)."""
    args, consts = launch
    out = torch.empty(1, device=q.device)  # the fp32 outputs
    extent = device_constant((0,), q.device, torch.int64)
    tuples = tuple(a + (c[SOURCE_CONSTS.index("BLOCK")], 2 * i, 2, 2 * i, 0, extent)
                   for i, (a, c) in enumerate(zip(args, consts["CONSTS"])))
    return _paged_partial_kernel.warmup(q, out, out, out, 2 * len(args), cols, 1.0, tuples, grid=(1, 1), **consts)


def _folds(src: PagedSource, block: int, dtype: torch.dtype) -> bool:
    """Whether KIVI keys are scored with their scales in the queries (:func:`_kivi_key_scores`):
    the tile's ``block`` tokens (16 or more) must lie in one token group (powers of two
    dividing the block size). Measured on an H100 (kivi2, groups of 32): 4% faster than
    dequantizing on 32-token tiles, and 22% slower on 64-token tiles when each of the two
    runs dotted the whole tile, so a tile longer than its group dequantizes. Not for fp16
    queries, whose product with a scale could overflow fp16 where the dense keys do not."""
    tg = src.key.token_group
    return (src.key.fmt == "int_channel" and dtype != torch.float16 and 16 <= block <= tg
            and tg == next_pow2(tg) and block == next_pow2(block) and src.block_size % tg == 0)


def _exact(op: KVOperand, dtype: torch.dtype) -> bool:
    """Whether the operand's values go to the tensor cores in fp16 (see ``EXACT_FORMATS``)."""
    return op.fmt in EXACT_FORMATS and dtype != torch.float32


def _operand_args(op: KVOperand, device) -> tuple:
    # a pointer for the arrays a format lacks (never read): one tensor per device, not a
    # fill kernel per call (128 graph nodes per step at 32 layers)
    dummy = device_constant((0.0,), device, torch.float32)
    return (op.codes, op.scale if op.scale is not None else dummy, op.minimum if op.minimum is not None else dummy,
            op.head_scale.float().contiguous() if op.head_scale is not None else dummy)


def _operand_constants(op: KVOperand, D: int) -> tuple[int, int, int]:
    """(bits, channel group of ``int`` scales, token group of ``int_channel`` scales)."""
    group = D // op.scale.shape[-1] if op.fmt == "int" else 1
    return op.bits, group, op.token_group
