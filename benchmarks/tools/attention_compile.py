"""Compile the paged decode-attention kernels for sm_90 without a GPU, one variant per format.

The interpreter accepts code the compiler rejects, so the CPU suite compiles every
(key format, value format) pair the store produces, at head dims 64 and 128 and GQA
groups 1 and 8, with the ``ptxas`` of the Triton wheel. Run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sass import compile_for_hopper  # noqa: E402

from kvcompose.ops import compact_rows, rotate_rows, scatter_slots  # noqa: E402
from kvcompose.ops.paged_attention import formats, kernels, launch  # noqa: E402

# (key format, value format, codes dtype, scale dtype, bits)
PAIRS = [("dense", "dense", "bf16", "fp32", 0), ("fp8", "fp8", "u8", "fp32", 0), ("nvfp4", "nvfp4", "u8", "u8", 0),
         ("ternary", "ternary", "u8", "u8", 0), ("int", "int", "u8", "fp16", 4), ("int_channel", "int", "u8", "fp16", 2)]


def partial_variant(kfmt, vfmt, codes, scale, bits, group, head_dim, scores, block=launch.TILE_SHAPE[0],
                    buffer=True, head_major=False):
    """Signature and constants of one launch: a pool in the given formats (``head_major``: its
    rows by head), then (``buffer``) the dense bf16 recent buffer on the light tile, as the
    store hands them over."""
    def source(kc, ks, vc, vs):
        ptrs = ("*i32", "*u8", f"*{kc}", f"*{ks}", f"*{ks}", "*fp32", f"*{vc}", f"*{vs}", f"*{vs}", "*fp32")
        return ptrs + ("i32",) * 7 + ("*i64",)  # table width, head rows ... first column, then the rows' extents

    per = 8 // bits if bits else {"nvfp4": 2, "ternary": 4}.get(kfmt, 1)
    pool = dict(KFMT=formats.FORMATS[kfmt], VFMT=formats.FORMATS[vfmt], KBITS=bits, VBITS=bits, KGROUP=32, VGROUP=32, KTG=16,
                KPER=per, VPER=per, KEX=kfmt in formats.EXACT_FORMATS, VEX=vfmt in formats.EXACT_FORMATS,
                KFOLD=kfmt == "int_channel", BS=16, BLOCK=block, STAGES=launch.STAGES,  # KIVI: 16-slot token groups
                EXTENT=not scores, HM=head_major)
    dense = dict(KFMT=0, VFMT=0, KBITS=0, VBITS=0, KGROUP=1, VGROUP=1, KTG=1, KPER=1, VPER=1, KEX=False, VEX=False,
                 KFOLD=False, BS=16, BLOCK=launch.SMALL_TILE, STAGES=launch.SMALL_STAGES, EXTENT=False, HM=False)
    sources = [source(codes, scale, codes, scale)] + ([source("bf16", "fp32", "bf16", "fp32")] if buffer else [])
    consts = [tuple(c[n] for n in kernels.SOURCE_CONSTS) for c in [pool] + ([dense] if buffer else [])]
    sig = {"q_ptr": "*bf16", "out_ptr": "*fp32", "lse_ptr": "*fp32", "score_ptr": "*fp32", "total_splits": "i32",
           "total_cols": "i32", "qk_scale": "fp32", "sources": tuple(sources)}
    return sig, dict(CONSTS=tuple(consts), NSRC=len(consts), H=8 // group if group > 1 else 8, G=group, GP=launch.query_rows(group, kfmt == "dense"),
                     D=head_dim, SCORES=scores, PREC="tf32", OUT=1, NATIVE=True)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    count = 0
    for kfmt, vfmt, codes, scale, bits in PAIRS:
        # the launch shape (launch.TILE_SHAPE) and two warps on 64-token tiles (the sweep's
        # alternative), each at one of the (group, head dim) cases
        for (group, head_dim), (block, warps) in zip(((1, 64), (8, 128)), ((64, 2), launch.TILE_SHAPE)):
            sig, consts = partial_variant(kfmt, vfmt, codes, scale, bits, group, head_dim, kfmt == "dense", block)
            kernel = compile_for_hopper(kernels._paged_partial_kernel, sig, consts, warps)
            print(f"partial {kfmt}/{vfmt} G={group} D={head_dim} tile {block} x {warps} warps: "
                  f"{len(kernel.asm['cubin'])} bytes of cubin", flush=True)
            count += 1
        # the pool's rows by head (Policy.pool_layout="head")
        sig, consts = partial_variant(kfmt, vfmt, codes, scale, bits, 8, 128, False, head_major=True)
        kernel = compile_for_hopper(kernels._paged_partial_kernel, sig, consts, launch.TILE_SHAPE[1])
        print(f"partial {kfmt}/{vfmt} head-major: {len(kernel.asm['cubin'])} bytes of cubin", flush=True)
        count += 1
    # KIVI keys decoded per element (fp16 queries, token groups under 16 slots)
    sig, consts = partial_variant("int_channel", "int", "u8", "fp16", 2, 4, 128, False)
    kivi = dict(zip(kernels.SOURCE_CONSTS, consts["CONSTS"][0]), KFOLD=False)
    consts = dict(consts, CONSTS=(tuple(kivi.values()), consts["CONSTS"][1]), OUT=2)
    kernel = compile_for_hopper(kernels._paged_partial_kernel, dict(sig, q_ptr="*fp16"), consts, 1)
    print(f"partial int_channel/int per element, fp16: {len(kernel.asm['cubin'])} bytes of cubin", flush=True)
    count += 1
    sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*i16", "final_lse_ptr": "*fp32", "S": "i32"}
    for warps, width in ((launch.MERGE_WARPS, 128), (launch.MERGE_WARPS, launch.MERGE_SLICE)):  # whole rows, sliced
        kernel = compile_for_hopper(kernels._merge_kernel, sig, dict(D=128, SP=128, DP=width, OUT=1, CHUNK=launch.MERGE_CHUNK),
                                    warps)
        print(f"merge, {warps} warps, {width} channels: {len(kernel.asm['cubin'])} bytes of cubin")
        count += 1
    for group in (1, 4):  # the buffer's partial and the merge, beside the CUDA kernel's partial results
        sig, consts = partial_variant("dense", "dense", "bf16", "fp32", 0, group, 128, False, launch.SMALL_TILE,
                                      buffer=False)
        consts = dict(consts, CONSTS=(consts["CONSTS"][0][:-4] + (launch.SMALL_TILE, launch.SMALL_STAGES, True, False),))
        sig = {"q_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*i16", "final_lse_ptr": "*fp32",
               "S": "i32", "qk_scale": "fp32", "sources": sig["sources"]}
        merge = {k: consts[k] for k in launch.RIDER_MERGE_CONSTS}
        kernel = compile_for_hopper(kernels._rider_merge_kernel, sig, dict(merge, SP=16, CHUNK=launch.MERGE_CHUNK),
                                    launch.TILE_SHAPE[1])
        print(f"buffer and merge, G={group}: {len(kernel.asm['cubin'])} bytes of cubin")
        count += 1
    sig = {**{f"x{i}_ptr": "*bf16" for i in range(3)}, **{f"o{i}_ptr": "*i16" for i in range(3)},
           "sign_ptr": "*bf16", "m_ptr": "*bf16", **{f"s{i}{d}": "i32" for i in range(3) for d in "bh"}}
    kernel = compile_for_hopper(rotate_rows._rotate_rows_kernel, sig, dict(H=8, G0=4, G1=1, G2=1, D=128, R=16,
                                                                          SIGNS_FIRST=True, OUT=1, LOW=True), 4)
    print(f"rotation of a step's queries, keys and values: {len(kernel.asm['cubin'])} bytes of cubin")
    count += 1
    sig = {"logit_ptr": "*fp32", "lse_ptr": "*fp32", "table_ptr": "*i64", "valid_ptr": "*u8", "mass_ptr": "*fp32",
           "weight_ptr": "*fp32", "W": "i32", "tokens": "i32", "col0": "i32", "total_cols": "i32"}
    kernel = compile_for_hopper(kernels._mass_kernel, sig, dict(HQ=32, HP=32, BS=16, BLOCK=launch.MASS_BLOCK), launch.WARPS)
    print(f"attention mass: {len(kernel.asm['cubin'])} bytes of cubin")
    count += 1
    rows = ("*i32", "*i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32")  # a pool tensor's words and strides
    sig = {"tensors": (rows,), "source_ptr": "*i64", "target_ptr": "*i64", "mask_ptr": "*i1", "n": "i32"}
    for gather, scatter, every, what in ((False, False, False, "slot copies of a pack"),
                                         (True, False, False, "slot gathers of a view"),
                                         (False, True, False, "slot scatters of a compaction"),
                                         (False, True, True, "slot scatters of a compaction's metadata")):
        consts = dict(SHAPES=((64, 64, False),), BLOCK=64, GATHER=gather, SCATTER=scatter, EVERY=every)
        kernel = compile_for_hopper(scatter_slots._copy_kernel, sig, consts, 4)
        print(f"{what} (per head where rows are head-major): {len(kernel.asm['cubin'])} bytes of cubin")
        count += 1
    pool = {"tensors": (rows, rows, ("*u8", "*u8", *rows[2:]), ("*i32", "*i32", *rows[2:])),
            "source_ptr": "*i64", "target_ptr": "*i64", "mask_ptr": "*i1", "n": "i32"}
    consts = dict(SHAPES=((16, 16, False), (2, 2, False), (1, 1, True), (2, 2, True)), BLOCK=256, GATHER=False,
                  SCATTER=False, EVERY=False)
    kernel = compile_for_hopper(scatter_slots._copy_kernel, pool, consts, 4)
    print(f"a pack of a whole pool (payload, then metadata cleared): {len(kernel.asm['cubin'])} bytes of cubin")
    count += 1
    for dtype in ("i32", "u8", "i64"):
        sig = {"x_ptr": f"*{dtype}", "keep_ptr": "*i1", "fill": "i32", "N": "i32", "E": "i32"}
        kernel = compile_for_hopper(compact_rows._compact_rows_kernel, sig, dict(N_P=128, E_BLOCK=32), 4)
        print(f"buffer compaction ({dtype} words): {len(kernel.asm['cubin'])} bytes of cubin")
        count += 1
    print(f"compiled {count} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
