"""Every quantization kernel compiles for sm_90 at the variants the library launches.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as Python and accepts code the
compiler rejects, so the CPU suite compiles them too, with the ``ptxas`` the Triton
wheel ships (no GPU needed), in a subprocess where the kernels are not interpreted.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "kernel_sass.py"


def _can_compile_for_hopper() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.tools.disasm import get_sass  # noqa: F401
    except ImportError:
        return False
    return True


def compiled(*args: str) -> str:
    """stdout of ``python *args`` with the kernels compiled, not interpreted; fails on errors."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


PREAMBLE = """
import sys
sys.path.insert(0, {bench!r})
from kernel_sass import compile_for_hopper
"""


COMPILE_VARIANTS = """
for fn, sig, consts, warps in variants:
    compile_for_hopper(fn, sig, consts, warps)
print(f"compiled {{len(variants)}} kernels")
"""


def compiles(body: str, kernels: int) -> None:
    """Compile the ``variants`` that ``body`` lists, ``(kernel, signature, constexprs, warps)`` each."""
    out = compiled("-c", (PREAMBLE + body + COMPILE_VARIANTS).format(bench=str(SCRIPT.parent)))
    assert f"compiled {kernels} kernels" in out, out


hopper = pytest.mark.skipif(not _can_compile_for_hopper(), reason="needs Triton with ASTSource and its bundled ptxas")


@hopper
def test_quant_kernels_compile_for_hopper():
    out = compiled(str(SCRIPT))
    lines = [line for line in out.splitlines() if "instr/value" in line]
    assert len(lines) == 17, out  # 6 two-level kernels x 2 scale layouts + 5 INT variants


@hopper
def test_attention_kernels_compile_for_hopper():
    out = compiled(str(SCRIPT.parent / "attention_compile.py"))
    assert "compiled 33 kernels" in out, out


REDUNDANCY_COMPILE = """
from kvcompose.ops import redundancy as r

sig = {{"k_ptr": "*bf16", "r_ptr": "*fp32", "pos_ptr": "*i32", "row_sum_ptr": "*fp32", "col_ptr": "*i64",
        "sim_ptr": "*fp32", "L": "i32", "H": "i32", "tiles": "i32", "stride_kb": "i32", "stride_kh": "i32",
        "stride_kl": "i32", "threshold": "fp32"}}
variants = [(r._redundancy_kernel, {{**sig, "k_ptr": "*" + keys}},
             dict(D=128, DP=128, BM=r.BLOCK_ROWS, BN=r.BLOCK_COLS, BETA=beta, PREC=prec, NATIVE=True), r.WARPS)
            for keys, beta, prec in (("bf16", False, "tf32"), ("bf16", True, "tf32"), ("fp16", True, "tf32"))]
# fp32 keys (an IEEE fp32 dot) on small tiles: at the launch tiles ptxas takes over half a minute.
variants.append((r._redundancy_kernel, {{**sig, "k_ptr": "*fp32"}},
                 dict(D=32, DP=32, BM=32, BN=16, BETA=True, PREC="ieee", NATIVE=True), r.WARPS))
# One candidate (the JIT makes an int argument equal to 1 a constant) and a padded head dim.
one = {{n: t for n, t in sig.items() if n != "L"}}
variants.append((r._redundancy_kernel, {{**one, "L": "constexpr"}},
                 dict(L=1, D=96, DP=128, BM=16, BN=16, BETA=True, PREC="tf32", NATIVE=True), r.WARPS))
"""


@hopper
def test_redundancy_kernel_compiles_for_hopper():
    compiles(REDUNDANCY_COMPILE, 5)


APPEND_COMPILE = """
from kvcompose.ops import append_token as a

variants = []
for dtype in ("bf16", "fp16", "fp32"):
    for ring in (False, True):  # with the query ring of policies that score with recent queries
        sig = {{"k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "ksb": "i64", "ksh": "i64", "ksd": "i64", "vsb": "i64",
                "vsh": "i64", "vsd": "i64", "bk_ptr": "*" + dtype, "bv_ptr": "*" + dtype, "len_ptr": "*i64",
                "seen_ptr": "*i64", "column_ptr": "*i64", "positions_ptr": "*i64", "cls_in_ptr": "*i64",
                "bpos_ptr": "*i64", "bvalid_ptr": "*u8", "bcls_ptr": "*i64", "overflow_ptr": "*i32",
                "nonfinite_ptr": "*i32", "zero_ptr": "*fp32", "q_ptr": "*" + dtype, "qsb": "i64", "qsh": "i64", "qsd": "i64",
                "ring_q_ptr": "*" + dtype, "ring_pos_ptr": "*i64"}}
        consts = dict(CAP=144, H=8, D=128, HD_P=1024, ZERO=not ring, RING=ring, W=8 if ring else 1, HQ=32 if ring else 1,
                      QD_P=4096 if ring else 1)
        variants.append((a._append_token_kernel, sig, consts, 4))
"""


@hopper
def test_append_token_kernel_compiles_for_hopper():
    compiles(APPEND_COMPILE, 6)


KMEANS_COMPILE = """
from kvcompose.ops import kmeans as km

sig = {{"x_ptr": "*bf16", "start_ptr": "*i64", "live_ptr": "*i1", "k_ptr": "*i32", "gram_ptr": "*fp32",
        "w_ptr": "*fp32", "keep_ptr": "*i8", "N": "i32", "F": "i32", "FD": "i32", "ITERS": "i32",
        "sxh": "i32", "sxf": "i32", "svs": "i32", "svn": "i32"}}
# the Gram formed from the keys, or read (summed over tensor-parallel ranks)
variants = [(km._kmeans_kernel, sig, dict(NP=128, KP=64, BF=km.BLOCK_F, BI=km.BLOCK_I, TIE_REL=km.TIE_REL,
                                          NATIVE_DOT=True, GRAM_GIVEN=given), 8) for given in (False, True)]
"""


@hopper
def test_kmeans_kernel_compiles_for_hopper():
    compiles(KMEANS_COMPILE, 2)
