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

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_sass.py"


def _can_compile_for_hopper() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.tools.disasm import get_sass  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _can_compile_for_hopper(), reason="needs Triton with ASTSource and its bundled ptxas")
def test_quant_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "instr/value" in line]
    assert len(lines) == 17, done.stdout  # 6 two-level kernels x 2 scale layouts + 5 INT variants


@pytest.mark.skipif(not _can_compile_for_hopper(), reason="needs Triton with ASTSource and its bundled ptxas")
def test_attention_kernels_compile_for_hopper():
    script = SCRIPT.parent / "attention_compile.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiled 13 kernels" in done.stdout, done.stdout
