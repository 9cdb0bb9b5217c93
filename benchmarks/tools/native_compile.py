"""Compile the CUDA decode kernel's device code for sm_90 without a GPU, and print each kernel's
registers and shared memory as ``ptxas`` reports them.

Where no GPU is at hand, this is how a change to ``native_packed.cu`` is checked before it goes
to one. The launchers at the end of the file need torch's CUDA headers; the kernels do not, so
the tool compiles the source up to the launchers, plus a host function that instantiates every
kernel the launcher dispatches to (``KERNELS``: format, head dim, query dtype). ``nvcc`` comes
from ``--nvcc``, ``CUDA_HOME`` or ``PATH``; a machine without a CUDA toolkit can take one from
NVIDIA's wheels on PyPI (``nvidia-cuda-nvcc``, ``nvidia-nvvm``, ``nvidia-cuda-runtime`` and
``nvidia-cuda-cccl`` of one CUDA release, unpacked into one tree: its ``bin/nvcc``, with
``--include`` at its ``include/cccl``). A development tool: stdout only.

    python benchmarks/tools/native_compile.py --nvcc /opt/cuda/bin/nvcc
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "kvcompose" / "ops" / "paged_attention" / "native_packed.cu"
#: (format, head dim, query dtype) of every kernel ``packed_partial`` dispatches to
KERNELS = [(fmt, dim, dtype) for fmt, dim in (("NVFP4", 64), ("NVFP4", 128), ("TERNARY", 128), ("INT4", 64),
                                              ("INT4", 128), ("INT2", 128), ("KIVI4", 64), ("KIVI4", 128),
                                              ("KIVI2", 128))
           for dtype in ("__nv_bfloat16", "__half")]
LAUNCHERS = "template <int F, int D, typename T>\nvoid launch("


def dispatched(source: str) -> set[tuple[str, int, str]]:
    """The (format, head dim, dtype) triples the source's launcher dispatches to (``KVC_LAUNCH(format,
    head dim)`` launches either query dtype)."""
    return {(f, int(d), t) for f, d in re.findall(r"KVC_LAUNCH\(([A-Z]\w*), (\d+)\)", source)
            for t in ("__nv_bfloat16", "__half")}


def format_codes(source: str) -> dict[str, int]:
    """The source's format codes (``constexpr int NVFP4 = 0, TERNARY = 1;``)."""
    line = re.search(r"constexpr int (NVFP4 = \d+(?:, \w+ = \d+)*);", source)
    return {name: int(code) for name, code in re.findall(r"(\w+) = (\d+)", line.group(1))}


def device_source(source: str) -> str:
    """The kernels of ``source`` without torch, and a host function launching each of ``KERNELS``."""
    if LAUNCHERS not in source:
        raise SystemExit(f"{SOURCE.name}: the launchers ({LAUNCHERS.splitlines()[1]}...) were not found")
    device = source[:source.index(LAUNCHERS)]
    for header in ("#include <torch/extension.h>", "#include <ATen/cuda/CUDAContext.h>"):
        device = device.replace(header, "")
    calls = "".join(f"  packed_partial_kernel<{f}, {d}, {t}><<<1, 32>>>(reinterpret_cast<const {t}*>(q), part, lse, "
                    "valid, kc, ks, khs, vc, vs, vhs, km, vm, R, 1, 4, 4, 1, 1.f, 0);\n" for f, d, t in KERNELS)
    return (device + "}  // namespace\n\nvoid launch_all(const void* q, float* part, float* lse, const uint8_t* valid, "
            "const uint8_t* kc, const uint8_t* ks, const float* khs, const uint8_t* vc, const uint8_t* vs, "
            "const float* vhs, const uint8_t* km, const uint8_t* vm, Regions R) {\n" + calls + "}\n")


def find_nvcc(given: str | None) -> str | None:
    if given:
        return given
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def compile_kernels(nvcc: str, include: list[str], arch: str = "sm_90") -> list[str]:
    """Compile; returns ``ptxas``'s lines on registers and shared memory, one per kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "native_device.cu"
        path.write_text(device_source(SOURCE.read_text()))
        cmd = [nvcc, f"-arch={arch}", "-O3", "-std=c++17", "-c", str(path), "-o", str(Path(tmp) / "native.o"),
               "-Xptxas", "-v", *[f"-I{i}" for i in include]]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = (done.stdout + done.stderr).splitlines()
    names = [re.search(r"packed_partial_kernelILi(\d+)ELi(\d+)E\d+(\w+?)EEv", line) for line in lines
             if "Compiling entry" in line]
    usage = [line.split(":", 1)[1].strip() for line in lines if "Used" in line]
    formats = {code: name for name, code in format_codes(SOURCE.read_text()).items()}
    return [f"{formats[int(m.group(1))]} D={m.group(2)} {m.group(3)}: {u}" for m, u in zip(names, usage) if m]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvcc", help="the nvcc to use (default: CUDA_HOME/bin/nvcc, then PATH)")
    p.add_argument("--include", action="append", default=[], help="more include folders (the CCCL headers)")
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args(argv)
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("no nvcc: pass --nvcc, set CUDA_HOME or put nvcc on PATH", file=sys.stderr)
        return 2
    for line in compile_kernels(nvcc, args.include, args.arch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
