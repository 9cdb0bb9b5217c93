"""Compile the quantization kernels for sm_90 without a GPU and count SASS instructions per value.

A development tool, not a benchmark: the Triton wheel carries ``ptxas`` and
``cuobjdump``, so any machine with Triton installed can compile the kernels for a
Hopper target and read the machine code. Two uses:

- **Compile check.** ``TRITON_INTERPRET=1`` tests run the kernels as Python, which
  accepts things the compiler rejects (for example a helper whose two ``return``
  statements have different integer types). Compiling every kernel at every
  ``constexpr`` variant the library launches catches those before a GPU run.
- **Cost model.** The quantize kernels are bound by instruction issue, not memory, and
  mostly by Hopper's ALU pipe (integer, logic, compare, select and float min/max), which
  takes a warp instruction every other cycle; fp32 add/multiply/FMA and IMAD go to the
  FMA pipes. ncu on an H200 showed the ALU pipe 79-91% busy in the NVFP4, ternary and
  INT2 quantize kernels. So two numbers per kernel: instructions per value up to the
  first ``EXIT`` (what one thread executes; branches to slow paths are rare) and those
  of them on the ALU pipe; a kernel needs about ``max(total, 2 * alu)`` issue cycles.
  Shared memory > 0 means a layout conversion (values exchanged between threads).

    python benchmarks/tools/kernel_sass.py            # every kernel, per-head and per-token scales
    python benchmarks/tools/kernel_sass.py --top 12   # also the most frequent instruction kinds

Written against Triton 3.9's ``ASTSource``/``triton.compile``; other versions may
need small changes. Needs ``TRITON_INTERPRET`` unset (it is cleared here).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # kernels must be JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402

from kvcompose.ops import quant_fp8, quant_int, quant_int_channel, quant_nvfp4, quant_ternary  # noqa: E402

H, D = 8, 128  # Llama-3-8B KV shape


def compile_for_hopper(fn, signature: dict, constexprs: dict, num_warps: int, aligned_ints=()):
    """Compile ``fn`` for sm_90 with 16-byte aligned pointers (as the JIT would specialize them)."""
    attrs = {}

    def mark(path, ty, name):  # a pointer, or a pointer inside a tuple argument (keyed by its path)
        if isinstance(ty, tuple):
            for j, t in enumerate(ty):
                mark(path + (j,), t, name)
        elif ty.startswith("*") or name in aligned_ints:
            attrs[path] = [["tt.divisibility", 16]]

    for i, (name, ty) in enumerate(signature.items()):
        mark((i,), ty, name)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_ops(kernel) -> list[str]:
    ops = []
    for line in get_sass(kernel.asm["cubin"]).splitlines():
        if "\t" not in line:
            continue
        op = line.split("\t", 1)[1].strip()
        if op.startswith("@"):
            op = op.split(None, 1)[1]
        ops.append(op.split()[0].rstrip(";"))
    return ops


# Opcodes issued to the ALU pipe on sm_90 (the rest: FMA pipes, memory, control, XU).
ALU_OPS = {"FMNMX", "FSETP", "FSEL", "SEL", "LOP3", "SHF", "IADD3", "ISETP", "VIMNMX", "VIADD", "LEA", "PRMT",
           "SGXT", "P2R", "R2P", "PLOP3", "IMNMX", "HSETP2", "HMNMX2", "MOV", "BMSK", "FCHK", "IABS"}


def executed_ops(ops: list[str]) -> list[str]:
    """The straight-line path a thread runs: everything before the first ``EXIT``."""
    return ops[: ops.index("EXIT")] if "EXIT" in ops else ops


def kernels(st: int):
    """(name, jit function, signature, constexprs, warps, values per program) for one scale layout."""
    blk = {"H": "constexpr", "NB": "constexpr", "BLOCKS": "constexpr", "ST": "constexpr"}
    nb = D // 16
    yield ("fp8 quantize", quant_fp8._fp8_quantize_kernel,
           {"x_ptr": "*bf16", "scale_ptr": "*fp32", "code_ptr": "*u8", "flag_ptr": "*i32", "n_rows": "i32",
            "H": "constexpr", "D": "constexpr", "BD": "constexpr", "ROWS": "constexpr", "ST": "constexpr",
            "HW": "constexpr"},
           {"H": H, "D": D, "BD": D, "ROWS": quant_fp8.QUANT_TILE // D, "ST": st, "HW": True},
           quant_fp8.QUANT_WARPS, quant_fp8.QUANT_TILE)
    yield ("fp8 dequantize", quant_fp8._fp8_dequantize_kernel,
           {"code_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*i16", "n_rows": "i32", "H": "constexpr",
            "D": "constexpr", "BD": "constexpr", "ROWS": "constexpr", "ST": "constexpr", "OUT": "constexpr",
            "HW": "constexpr"},
           {"H": H, "D": D, "BD": D, "ROWS": quant_fp8.DEQUANT_TILE // D, "ST": st, "OUT": 1, "HW": True},
           quant_fp8.DEQUANT_WARPS, quant_fp8.DEQUANT_TILE)
    for label, mod, quant_ptrs, flag, tile, dequant_codes in (
        ("nvfp4", quant_nvfp4, {"x_ptr": "*i32", "s2_ptr": "*fp32", "code_ptr": "*u8"}, "WORDS",
         quant_nvfp4.TILE_BLOCKS, {"code_ptr": "*u8"}),
        ("ternary", quant_ternary, {"x_ptr": "*bf16", "s2_ptr": "*fp32", "word_ptr": "*i32"}, "NATIVE",
         quant_ternary.QUANT_TILE, {"word_ptr": "*i32"}),
    ):
        yield (f"{label} quantize", getattr(mod, f"_{label}_quantize_kernel"),
               {**quant_ptrs, "bs_ptr": "*u8", "flag_ptr": "*i32", "n_blocks": "i32", **blk, flag: "constexpr"},
               {"H": H, "NB": nb, "BLOCKS": tile, "ST": st, flag: True}, mod.QUANT_WARPS, 16 * tile)
        dtile = getattr(mod, "DEQUANT_TILE_BLOCKS", None) or mod.DEQUANT_TILE
        yield (f"{label} dequantize", getattr(mod, f"_{label}_dequantize_kernel"),
               {**dequant_codes, "bs_ptr": "*u8", "s2_ptr": "*fp32", "out_ptr": "*i16", "n_blocks": "i32", **blk,
                "OUT": "constexpr"},
               {"H": H, "NB": nb, "BLOCKS": dtile, "ST": st, "OUT": 1}, mod.DEQUANT_WARPS, 16 * dtile)
    if st:
        return  # INT formats have no second-level scale
    values, warps = quant_int.TOKEN_QUANT
    token_sig = {"x_ptr": "*fp16", "code_ptr": "*u8", "scale_ptr": "*fp16", "lo_ptr": "*fp16", "flag_ptr": "*i32",
                 "n_groups": "i32", "GS": "constexpr", "BITS": "constexpr", "HALF": "constexpr", "GROUPS": "constexpr",
                 "BG": "constexpr", "WORDS": "constexpr"}
    token_const = {"GS": D, "HALF": True, "GROUPS": values // D, "BG": D}
    yield ("int4 token quantize (fp16 input)", quant_int._int_token_quantize_kernel, token_sig,
           {**token_const, "BITS": 4, "WORDS": False}, warps, values)
    for bits in (4, 2):  # bf16 input, read as words
        yield (f"int{bits} token quantize", quant_int._int_token_quantize_kernel,
               {**token_sig, "x_ptr": "*i64" if bits == 2 else "*i32"}, {**token_const, "BITS": bits, "WORDS": True},
               warps, values)
        yield (f"int{bits} channel quantize (KIVI keys)", quant_int_channel._int_channel_quantize_kernel,
               {"x_ptr": "*bf16", "code_ptr": "*u8", "scale_ptr": "*fp16", "lo_ptr": "*fp16", "flag_ptr": "*i32",
                "N": "i32", "H": "constexpr", "D": "constexpr", "G": "constexpr", "BITS": "constexpr",
                "HALF": "constexpr", "BLOCK_G": "constexpr", "BD": "constexpr", "CHUNK": "constexpr"},
               {"H": H, "D": D, "G": 32, "BITS": bits, "HALF": True, "BLOCK_G": 32, "BD": D,
                "CHUNK": quant_int_channel.CHANNEL_QUANT_CHUNK},
               quant_int_channel.CHANNEL_QUANT_WARPS, 32 * D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=0, help="also list the N most frequent instruction kinds")
    args = ap.parse_args(argv)
    failed = 0
    for st, layout in ((0, "per-head scale"), (H, "per-token scale")):
        for name, fn, sig, consts, warps, values in kernels(st):
            label = f"{name} ({layout})" if "int" not in name else name
            try:
                kernel = compile_for_hopper(fn, sig, consts, warps, aligned_ints=[n for n in sig if sig[n] == "i32"])
            except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
                failed += 1
                print(f"{label}: DOES NOT COMPILE: {str(exc).splitlines()[-1]}")
                continue
            ops = sass_ops(kernel)
            run = executed_ops(ops)
            per = 32 * kernel.metadata.num_warps / values
            alu = sum(op.split(".")[0] in ALU_OPS for op in run)
            print(f"{label:45s} {len(run) * per:5.1f} instr/value ({alu * per:4.1f} ALU pipe), "
                  f"{values // (32 * kernel.metadata.num_warps)} values/thread, shared {kernel.metadata.shared} B")
            if args.top:
                print("    ", collections.Counter(o.split(".")[0] for o in ops).most_common(args.top))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
