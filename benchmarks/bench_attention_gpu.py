"""Decode attention alone: the fused paged op per storage format and kernel against bf16 SDPA (flash).

Llama-3-8B shapes (32 query heads, 8 KV heads of 128), one query per row, B x L in
{1 x 32K, 16 x 8K, 64 x 4K, 256 x 1K}, and 16 x 8K at head dim 64 (the embedded model's).
Every format's tokens sit in shuffled 16-slot blocks of a pool (kivi2 and kivi4: 32-slot blocks and
token groups, as their presets) plus a 16-token bf16 recent buffer; ``mixed`` is ThinKV's
store as the ``thinkv`` preset keeps it (``THINKV_FORMATS``): each thought class a third of
the tokens, classes of one format as regions (block tables) of one pool, so R and E share an
NVFP4 pool and T has a ternary one; ``mixed-int`` is ``thinkv-int``'s (``THINKV_INT_FORMATS``:
R and E in INT4, groups of 32). The op is timed
as a CUDA-graph replay (its partial launches and the merge), once per kernel that takes the
format: ``triton`` always, ``cuda`` (the CUDA kernel of NVFP4, ternary, INT4, INT2 and KIVI pools) where it
is built.
Reported per (format, kernel, shape): milliseconds, effective TB/s on the bytes the op must
read (codes, scales, block tables, validity, queries), that rate as a fraction of the
device-to-device copy bandwidth measured in the same process, and the speed-ups over
``F.scaled_dot_product_attention`` on bf16 K/V of the same logical tokens (flash backend,
GQA, no mask) and over our own kernel on the bf16 pool. Each configuration is also checked
against the torch reference on its first rows.

    python benchmarks/bench_attention_gpu.py --smoke     # a few seconds
    python benchmarks/bench_attention_gpu.py             # the grid -> results/attention_gpu.json
    python benchmarks/bench_attention_gpu.py --formats bf16 kivi2 --buffer 160 --split-min 32
                                                         # KIVI's window as the buffer, short splits
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

from harness.results import ResultLog, result_path
from harness.table import format_table
from harness.timing import copy_tbps, graph_ms
from kvcompose import registry
from kvcompose.policies.policy import DEFAULT_POOL_LAYOUT, POOL_LAYOUTS
from kvcompose.policies.presets import THINKV_FORMATS, THINKV_INT_FORMATS
from kvcompose.ops.paged_attention import (
    KVOperand,
    PagedSource,
    bytes_read,
    head_major,
    paged_decode_attention,
    paged_decode_attention_torch,
)
from kvcompose.ops.paged_attention import launch, native
from kvcompose.ops.paged_attention.launch import NATIVE_TILE, TILE_SHAPE

Q_HEADS, KV_HEADS, BLOCK, BUFFER = 32, 8, 16, 16
SHAPES = [(1, 32768, 128), (16, 8192, 128), (64, 4096, 128), (256, 1024, 128), (16, 8192, 64)]  # (B, L, head dim)
SMOKE_SHAPES = [(1, 4096, 128), (16, 1024, 64)]
MIXED = THINKV_FORMATS  # the mixed store: thought class -> format, a third of the tokens each
MIXED_INT = THINKV_INT_FORMATS  # thinkv-int's mixed store, likewise
FORMATS = {  # label -> (key quantizer spec, value quantizer spec); None: bf16 as stored
    "bf16": (None, None),
    "fp8": ("fp8", "fp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "ternary": ("ternary", "ternary"),
    "int4": ({"name": "int", "bits": 4, "group_size": 32},) * 2,
    "int2": ({"name": "int", "bits": 2, "group_size": 32},) * 2,
    "kivi2": ({"name": "int", "bits": 2, "layout": "kivi", "token_group": 32},
              {"name": "int", "bits": 2, "layout": "kivi", "token_group": 32}),
    "kivi4": ({"name": "int", "bits": 4, "layout": "kivi", "token_group": 32},
              {"name": "int", "bits": 4, "layout": "kivi", "token_group": 32}),
    "mixed": (None, None),  # built from MIXED
    "mixed-int": (None, None),  # built from MIXED_INT
}
BLOCK_SIZES = {"kivi2": 32, "kivi4": 32}  # the kivi presets' blocks and token groups (16-slot blocks elsewhere)
UNIT = {"fp8": 1 / 448, "nvfp4": 1 / (6 * 448), "ternary": 1 / 448}
LAYOUT = DEFAULT_POOL_LAYOUT  # the pools' (slot, head) row order, as a Policy's by default (formats.row_layout)
TARGETS = {"frac_copy": 0.8, "speedup": {"nvfp4": 3.0, "ternary": 3.0, "fp8": 1.8, "bf16": 1.0}}


def operand(spec, role: str, x: torch.Tensor, row_of: torch.Tensor, B: int) -> KVOperand:
    if spec is None:
        return KVOperand("dense", x)
    q = registry.build("quantizer", spec)
    fmt = q.attention_format(role)
    if fmt in UNIT:
        hs = torch.full((B, x.shape[1]), 4.0 * 2 * UNIT[fmt], device=x.device)  # headroom 2 x amax ~4 of randn
        p = q.quantize(x, role=role, head_scale=hs[row_of])
        return KVOperand(fmt, p.codes, scale=getattr(p, "block_scales", None), head_scale=hs)
    p = q.quantize(x, role=role)
    return KVOperand(fmt, p.codes, p.scale, p.minimum, bits=q.bits, token_group=q.token_group)


def build(label: str, B: int, L: int, device, dim: int = 128, seed: int = 0) -> list[PagedSource]:
    """The pool + buffer sources of ``B`` rows of ``L`` tokens of head dim ``dim``; ``mixed`` and
    ``mixed-int``: see :func:`build_mixed`."""
    if label in ("mixed", "mixed-int"):
        return build_mixed(B, L, device, dim, MIXED if label == "mixed" else MIXED_INT)
    return build_pool(FORMATS[label], BLOCK_SIZES.get(label, BLOCK), B, L, device, dim, seed)


def build_mixed(B: int, L: int, device, dim: int, formats: dict) -> list[PagedSource]:
    """ThinKV's store: each class of ``formats`` a third of the pool tokens, the classes of one
    format as regions of one pool (each row's blocks of that pool cut into one run of table
    columns per class, as the store keeps its R and E regions), and the buffer."""
    classes_of: dict[str, list[str]] = {}  # classes of one format (the same quantizer spec) share a pool
    for name, spec in formats.items():
        classes_of.setdefault(repr(sorted(spec.items())), []).append(name)
    share = (L - BUFFER) // len(formats)
    sources, buffer = [], None
    for seed, classes in enumerate(classes_of.values()):
        pool, buffer = build_pool((formats[classes[0]],) * 2, BLOCK, B, share * len(classes) + BUFFER, device, dim, seed)
        edges = [pool.table.shape[1] * i // len(classes) for i in range(len(classes) + 1)]
        sources += [dataclasses.replace(pool, table=pool.table[:, a:b].contiguous()) for a, b in zip(edges, edges[1:])]
    return sources + [buffer]


def build_pool(specs: tuple, bs: int, B: int, L: int, device, dim: int, seed: int) -> list[PagedSource]:
    """A pool of ``L`` minus the buffer's tokens per row in ``bs``-slot blocks, keys and values
    quantized by ``specs`` (None: bf16 as stored), and the buffer."""
    g = torch.Generator(device=device).manual_seed(seed)
    pool_tokens = L - BUFFER
    W = pool_tokens // bs  # kivi2: 16 tokens fewer than L - BUFFER (whole 32-slot blocks)
    perm = torch.randperm(B * W, device=device, generator=g)
    table = perm.view(B, W)
    row_of = torch.arange(B, device=device).repeat_interleave(W)[torch.argsort(perm)].repeat_interleave(bs)
    n = B * W * bs
    kspec, vspec = specs
    # Quantize in chunks to bound the temporary bf16 tensors.
    k = torch.randn(n, KV_HEADS, dim, device=device, dtype=torch.bfloat16, generator=g)
    key = operand(kspec, "key", k, row_of, B)
    del k
    v = torch.randn(n, KV_HEADS, dim, device=device, dtype=torch.bfloat16, generator=g)
    value = operand(vspec, "value", v, row_of, B)
    del v
    valid = torch.ones(n, dtype=torch.bool, device=device)
    buf = torch.randn(2, B * BUFFER, KV_HEADS, dim, device=device, dtype=torch.bfloat16, generator=g)
    buffer = PagedSource(KVOperand("dense", buf[0]), KVOperand("dense", buf[1]),
                         torch.arange(B, device=device)[:, None], BUFFER, torch.ones(B * BUFFER, dtype=torch.bool,
                                                                                      device=device))
    pool = PagedSource(key, value, table, bs, valid)
    return [head_major(pool) if LAYOUT == "head" else pool, buffer]


def sdpa_ms(query: torch.Tensor, B: int, L: int) -> tuple[float, str]:
    """bf16 SDPA over ``L`` tokens per row, flash backend with GQA (or the best backend that runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(B, KV_HEADS, L, query.shape[-1], device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(query, k, v, enable_gqa=True)  # noqa: E731
                fn()
                return graph_ms(fn, 20), backend.name.lower()
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def check(query, sources, kernel: str) -> float:
    """Max abs difference to the torch reference on the first two rows."""
    n = min(2, query.shape[0])

    def rows(op: KVOperand) -> KVOperand:
        return dataclasses.replace(op, head_scale=None if op.head_scale is None else op.head_scale[:n])

    sub = [dataclasses.replace(s, key=rows(s.key), value=rows(s.value), table=s.table[:n]) for s in sources]
    out = paged_decode_attention(query[:n], sub, query.shape[-1] ** -0.5, backend=kernel)
    ref = paged_decode_attention_torch(query[:n], sub, query.shape[-1] ** -0.5)
    return (out.float() - ref.float()).abs().max().item()


def kernels_for(sources: list[PagedSource], query: torch.Tensor, kernels: list[str]) -> list[str]:
    """The kernels to time for these sources: "triton" always, "cuda" where the CUDA kernel takes the pool."""
    return [k for k in kernels if k == "triton" or any(native.fits(query, s) for s in sources)]


def run(shapes, formats, repeats: int, kernels: list[str]) -> tuple[float, list[dict]]:
    copy = copy_tbps("cuda")
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    results = []
    for B, L, dim in shapes:
        query = torch.randn(B, Q_HEADS, 1, dim, device="cuda", dtype=torch.bfloat16)
        base_ms, backend = sdpa_ms(query, B, L)
        torch.cuda.empty_cache()
        bf16_ms = None
        for label in formats:
            sources = build(label, B, L, "cuda", dim)
            for kernel in kernels_for(sources, query, kernels):
                ms = graph_ms(lambda: paged_decode_attention(query, sources, dim ** -0.5, backend=kernel), repeats)
                bf16_ms = ms if label == "bf16" else bf16_ms
                nbytes = bytes_read(sources, query)
                tbps = nbytes / (ms * 1e-3) / 1e12
                row = {"format": label, "kernel": kernel, "batch": B, "tokens": L, "head_dim": dim, "ms": ms,
                       "bytes": nbytes, "tb_per_s": tbps, "fraction_of_copy": tbps / copy, "sdpa_ms": base_ms,
                       "sdpa_backend": backend, "speedup_vs_sdpa": base_ms / ms,
                       "speedup_vs_bf16_kernel": None if bf16_ms is None else bf16_ms / ms,
                       "max_abs_diff_vs_reference": check(query, sources, kernel),
                       "launch": dict(zip(("tile_tokens", "warps"), TILE_SHAPE)) if kernel == "triton" else
                       {"tile_tokens": NATIVE_TILE, "warps": 1}, "layout": LAYOUT}
                results.append(row)
                print(f"{label:8s} {kernel:6s} B={B:4d} L={L:6d} D={dim:3d}  {ms:8.4f} ms  {tbps:5.2f} TB/s  "
                      f"{row['fraction_of_copy']:5.1%} of copy  sdpa {base_ms:8.4f} ms ({backend})  "
                      f"x{row['speedup_vs_sdpa']:.2f}  diff {row['max_abs_diff_vs_reference']:.2e}", flush=True)
            del sources
            torch.cuda.empty_cache()
    return copy, results


def table(results: list[dict]) -> str:
    rows = [[r["format"], r["kernel"], f"{r['batch']}x{r['tokens']}x{r['head_dim']}", f"{r['ms']:.4f}",
             f"{r['tb_per_s']:.2f}", f"{r['fraction_of_copy']:.0%}", f"{r['sdpa_ms']:.4f}", f"{r['speedup_vs_sdpa']:.2f}"]
            for r in results]
    return format_table(["format", "kernel", "BxLxD", "ms", "TB/s", "of copy", "sdpa ms", "x sdpa"], rows)


def main(argv=None) -> int:
    global LAYOUT, BUFFER
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="two small shapes, few repeats")
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--kernels", nargs="*", default=["triton", "cuda"], choices=["triton", "cuda"],
                   help="cuda: the CUDA kernel, timed where it takes the format and is built")
    p.add_argument("--riders-in-merge", choices=["native", "always", "never"], default=launch.RIDERS_IN_MERGE,
                   help="where the recent buffer beside CUDA-read pools is computed (launch.RIDERS_IN_MERGE)")
    p.add_argument("--layout", choices=list(POOL_LAYOUTS), default=DEFAULT_POOL_LAYOUT,
                   help="how the pools' (slot, head) rows lie (Policy.pool_layout; default: the Policy default)")
    p.add_argument("--buffer", type=int, default=BUFFER,
                   help="tokens per row in the bf16 recent buffer (16; KIVI's presets hold 128-160 there)")
    p.add_argument("--split-min", type=int, default=launch.TOKENS_PER_SPLIT_MIN,
                   help="fewest tokens per split of a source, in either kernel (launch.TOKENS_PER_SPLIT_MIN)")
    p.add_argument("--small-source", type=int, default=launch.SMALL_SOURCE_TOKENS,
                   help="longest source that takes the light tile and may ride in the merge launch "
                        "(launch.SMALL_SOURCE_TOKENS)")
    p.add_argument("--out", default=str(result_path("attention_gpu")), help="history file the run is added to")
    args = p.parse_args(argv)
    shortest = min(length for _, length, _ in (SMOKE_SHAPES if args.smoke else SHAPES))
    if not 1 <= args.buffer <= shortest // 2:
        p.error(f"--buffer {args.buffer}: give 1 to {shortest // 2} tokens (half the shortest row of the grid)")
    if args.split_min < 1:
        p.error(f"--split-min {args.split_min}: give a positive number of tokens")
    if args.small_source < 1:
        p.error(f"--small-source {args.small_source}: give a positive number of tokens")
    LAYOUT, BUFFER = args.layout, args.buffer
    if not torch.cuda.is_available():
        print("bench_attention_gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    log = ResultLog(args.out)
    launch.RIDERS_IN_MERGE = args.riders_in_merge
    launch.TOKENS_PER_SPLIT_MIN = args.split_min
    launch.SMALL_SOURCE_TOKENS = args.small_source
    wall = time.perf_counter()
    status = native.native_status(torch.device("cuda"))
    print(f"CUDA kernel: {status['kernel']} ({status['reason']})", flush=True)
    kernels = [k for k in args.kernels if k == "triton" or status["kernel"] == "cuda"]
    copy, results = run(SMOKE_SHAPES if args.smoke else SHAPES, args.formats, 5 if args.smoke else args.repeats,
                        kernels)
    data = {"benchmark": "fused paged decode attention vs bf16 SDPA", "smoke": args.smoke,
            "shapes": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "block_size": BLOCK, "mixed": MIXED, "mixed_int": MIXED_INT,
                       "block_sizes": BLOCK_SIZES,
                       "buffer_tokens": BUFFER},
            "riders_in_merge": args.riders_in_merge, "tokens_per_split_min": args.split_min,
            "small_source_tokens": args.small_source,
            "layout": args.layout, "formats": args.formats,
            "narrowed": set(args.formats) != set(FORMATS),
            "targets": TARGETS, "copy_tb_per_s": copy, "native_kernel": status, "results": results,
            "seconds": time.perf_counter() - wall}
    if not args.smoke:
        print(f"wrote {log.save(data)}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
