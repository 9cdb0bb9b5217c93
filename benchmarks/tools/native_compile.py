"""Compile the CUDA decode kernel's device code for sm_90 without a GPU, and print each kernel's
registers and shared memory as ``ptxas`` reports them.

Where no GPU is at hand, this is how a change to ``native_packed.cu`` is checked before it goes
to one. The launchers at the end of the file need torch's CUDA headers; the kernels do not, so
the tool compiles the source up to the launchers, plus a host function that instantiates every
kernel the launcher dispatches to (``KERNELS``: format, head dim, query dtype). ``nvcc`` comes
from ``--nvcc``, ``CUDA_HOME``, ``PATH`` or an installed NVIDIA wheel; a machine without a CUDA
toolkit can take one from NVIDIA's wheels on PyPI (``nvidia-cuda-nvcc``, ``nvidia-nvvm``, ``nvidia-cuda-runtime`` and
``nvidia-cuda-cccl`` of one CUDA release, unpacked into one tree: its ``bin/nvcc``, with
``--include`` at its ``include/cccl``). A development tool: stdout only.

With ``--loop`` it also disassembles the kernels (``cuobjdump`` from ``--cuobjdump``, ``CUDA_HOME``, ``PATH``
or NVIDIA's ``nvidia-cuda-cuobjdump`` wheel) and counts the instructions of each kernel's tile loop by
opcode: the loop is the backward branch's span with the most ``HMMA``. What a change to the decode costs per
tile, before it goes to a GPU.

    python benchmarks/tools/native_compile.py --nvcc /opt/cuda/bin/nvcc
    python benchmarks/tools/native_compile.py --nvcc /opt/cuda/bin/nvcc --loop
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
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


def find_tool(name: str, given: str | None) -> str | None:
    """A CUDA tool (``nvcc``, ``cuobjdump``): ``given``, else ``CUDA_HOME/bin``, ``PATH``, NVIDIA's wheels
    (``nvidia/cu*/bin``)."""
    if given:
        return given
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / name).exists():
        return str(Path(home) / "bin" / name)
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob(f"cu*/bin/{name}")):
            return str(path)
    return None


def kernel_name(mangled: str) -> str | None:
    """``FORMAT D=.. dtype`` of a kernel's mangled name, or None for another function."""
    m = re.search(r"packed_partial_kernelILi(\d+)ELi(\d+)E\d+(\w+?)EEv", mangled)
    if not m:
        return None
    formats = {code: name for name, code in format_codes(SOURCE.read_text()).items()}
    return f"{formats[int(m.group(1))]} D={m.group(2)} {m.group(3)}"


def run_nvcc(nvcc: str, include: list[str], arch: str, flags: list[str], then):
    """Compile the kernels (:func:`device_source`) with ``flags`` in a scratch folder, and return
    ``then(done, folder)`` while the folder's outputs are still there."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "native_device.cu"
        path.write_text(device_source(SOURCE.read_text()))
        done = subprocess.run([nvcc, f"-arch={arch}", "-O3", "-std=c++17", str(path), *flags,
                               *[f"-I{i}" for i in include]], capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return then(done, Path(tmp))


def compile_kernels(nvcc: str, include: list[str], arch: str = "sm_90") -> list[str]:
    """Compile; returns ``ptxas``'s lines on registers and shared memory, one per kernel."""
    done = run_nvcc(nvcc, include, arch, ["-c", "-o", "native.o", "-Xptxas", "-v"], lambda done, _: done)
    lines = (done.stdout + done.stderr).splitlines()
    names = [kernel_name(line) for line in lines if "Compiling entry" in line]
    usage = [line.split(":", 1)[1].strip() for line in lines if "Used" in line]
    return [f"{name}: {u}" for name, u in zip(names, usage) if name]


def loop_counts(sass: str) -> dict[str, collections.Counter]:
    """Per kernel of ``cuobjdump -sass`` output (``FORMAT D=.. dtype``): the opcodes of its tile loop, the span of
    the backward branch that holds the most HMMA (the shortest such span)."""
    counts = {}
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = kernel_name(function.split("\n", 1)[0])
        if name is None:
            continue
        code = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", function)]
        best = None
        for at, op in code:
            branch = re.search(r"\bBRA (0x[0-9a-f]+)", op)
            if branch and int(branch.group(1), 16) < at:
                span = [o for a, o in code if int(branch.group(1), 16) <= a <= at]
                key = (sum("HMMA" in o for o in span), -len(span))
                best = max(best, (key, span)) if best else (key, span)
        if best:
            counts[name] = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", o).split()[0].split(".")[0]
                                               for o in best[1])
    return counts


def disassemble(nvcc: str, cuobjdump: str, include: list[str], arch: str = "sm_90") -> str:
    def sass(_, folder: Path) -> str:
        return subprocess.run([cuobjdump, "-sass", str(folder / "native.cubin")], capture_output=True, text=True,
                              check=True).stdout

    return run_nvcc(nvcc, include, arch, ["-cubin", "-o", "native.cubin"], sass)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvcc", help="the nvcc to use (default: CUDA_HOME/bin/nvcc, then PATH)")
    p.add_argument("--include", action="append", default=[], help="more include folders (the CCCL headers)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--loop", action="store_true", help="also count each kernel's tile-loop instructions (cuobjdump)")
    p.add_argument("--cuobjdump", help="the cuobjdump to use (default: CUDA_HOME/bin, PATH, NVIDIA's wheel)")
    args = p.parse_args(argv)
    nvcc = find_tool("nvcc", args.nvcc)
    if nvcc is None:
        print("no nvcc: pass --nvcc, set CUDA_HOME or put nvcc on PATH", file=sys.stderr)
        return 2
    for line in compile_kernels(nvcc, args.include, args.arch):
        print(line)
    if args.loop:
        cuobjdump = find_tool("cuobjdump", args.cuobjdump)
        if cuobjdump is None:
            print("no cuobjdump: pass --cuobjdump, or pip install nvidia-cuda-cuobjdump", file=sys.stderr)
            return 2
        for name, ops in loop_counts(disassemble(nvcc, cuobjdump, args.include, args.arch)).items():
            print(f"{name}: loop {sum(ops.values())} instructions: "
                  + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
