"""Compile the paged decode-attention kernels for sm_90 without a GPU, one variant per format.

The interpreter accepts code the compiler rejects, so the CPU suite compiles every
(key format, value format) pair the store produces, at head dims 64 and 128 and GQA
groups 1 and 8, with the ``ptxas`` of the Triton wheel. Run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sass import compile_for_hopper  # noqa: E402

from kvcompose.ops import attention_launch as launch_plan  # noqa: E402
from kvcompose.ops import paged_attention as pa  # noqa: E402

# (key format, value format, codes dtype, scale dtype, bits)
PAIRS = [("dense", "dense", "bf16", "fp32", 0), ("fp8", "fp8", "u8", "fp32", 0), ("nvfp4", "nvfp4", "u8", "u8", 0),
         ("ternary", "ternary", "u8", "u8", 0), ("int", "int", "u8", "fp16", 4), ("int_channel", "int", "u8", "fp16", 2)]


def partial_variant(kfmt, vfmt, codes, scale, bits, group, head_dim, scores, block=launch_plan.FEW_ROWS_SHAPE[0]):
    ptr = {"q": "*bf16", "out": "*fp32", "lse": "*fp32", "score": "*fp32", "table": "*i32", "valid": "*u8"}
    for role in ("k", "v"):
        ptr.update({f"{role}c": f"*{codes}", f"{role}s": f"*{scale}", f"{role}m": f"*{scale}", f"{role}hs": "*fp32"})
    names = {"q": "q_ptr", "out": "out_ptr", "lse": "lse_ptr", "score": "score_ptr", "table": "table_ptr",
             "valid": "valid_ptr"}
    sig = {names.get(k, f"{k}_ptr"): v for k, v in ptr.items()}
    sig.update({"W": "i32", "tokens_per_split": "i32", "split0": "i32", "total_splits": "i32", "col0": "i32",
                "total_cols": "i32", "qk_scale": "fp32"})
    consts = dict(KFMT=pa.FORMATS[kfmt], VFMT=pa.FORMATS[vfmt], KBITS=bits, VBITS=bits, KGROUP=32, VGROUP=32,
                  KEX=kfmt in pa.EXACT_FORMATS, VEX=vfmt in pa.EXACT_FORMATS, KTG=16, H=8 // group if group > 1 else 8, G=group, GP=16, D=head_dim, BS=16,
                  BLOCK=block, SCORES=scores, PREC="tf32", OUT=1, NATIVE=True)
    consts["KPER"] = 8 // bits if bits else {"nvfp4": 2, "ternary": 4}.get(kfmt, 1)
    consts["VPER"] = consts["KPER"]
    consts["KFOLD"] = kfmt == "int_channel"  # KIVI keys: runs of 16 slots share a token group
    return sig, consts


def main() -> int:
    count = 0
    for kfmt, vfmt, codes, scale, bits in PAIRS:
        # both launch shapes (attention_launch.launch_shape), each at one of the (group, head dim) cases
        for (group, head_dim), (block, warps) in zip(((1, 64), (8, 128)), (launch_plan.FEW_ROWS_SHAPE, launch_plan.MANY_ROWS_SHAPE)):
            sig, consts = partial_variant(kfmt, vfmt, codes, scale, bits, group, head_dim, kfmt == "dense", block)
            kernel = compile_for_hopper(pa._paged_partial_kernel, sig, consts, warps)
            print(f"partial {kfmt}/{vfmt} G={group} D={head_dim} tile {block} x {warps} warps: "
                  f"{len(kernel.asm['cubin'])} bytes of cubin", flush=True)
            count += 1
    # KIVI keys decoded per element (fp16 queries, token groups under 16 slots)
    sig, consts = partial_variant("int_channel", "int", "u8", "fp16", 2, 4, 128, False)
    kernel = compile_for_hopper(pa._paged_partial_kernel, dict(sig, q_ptr="*fp16"), dict(consts, KFOLD=False, OUT=2), 1)
    print(f"partial int_channel/int per element, fp16: {len(kernel.asm['cubin'])} bytes of cubin", flush=True)
    count += 1
    sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*i16", "final_lse_ptr": "*fp32", "S": "i32"}
    for _, warps in (launch_plan.FEW_ROWS_SHAPE, launch_plan.MANY_ROWS_SHAPE):  # the merge runs on the partial kernel's warps
        kernel = compile_for_hopper(pa._merge_kernel, sig, dict(D=128, SP=128, DP=128, OUT=1, CHUNK=pa.MERGE_CHUNK),
                                    warps)
        print(f"merge, {warps} warps: {len(kernel.asm['cubin'])} bytes of cubin")
        count += 1
    sig = {"logit_ptr": "*fp32", "lse_ptr": "*fp32", "table_ptr": "*i64", "valid_ptr": "*u8", "mass_ptr": "*fp32",
           "weight_ptr": "*fp32", "W": "i32", "tokens": "i32", "col0": "i32", "total_cols": "i32"}
    kernel = compile_for_hopper(pa._mass_kernel, sig, dict(HQ=32, HP=32, BS=16, BLOCK=pa.MASS_BLOCK), pa.WARPS)
    print(f"attention mass: {len(kernel.asm['cubin'])} bytes of cubin")
    print(f"compiled {count + 1} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
