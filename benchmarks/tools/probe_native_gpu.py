"""Where the CUDA decode kernel's time goes: variants of ``native_packed.cu`` side by side.

Each variant is the kernel's source with one text substitution (more stages in the shared-memory
ring, or a part of the decode replaced by a cheaper stand-in that gives wrong numbers), built under
its own name for one format (``--format``, NVFP4 by default; bf16 queries, head dim 128) and timed on
that format's pool of :mod:`bench_attention_gpu`.
A stand-in that speeds the kernel up a lot names the part worth rewriting. Results go to stdout
and, with ``--out``, to a history file, saved after every variant
(``benchmarks/results/probe_native_gpu.json`` is where the docs read them). The variants that keep
the numbers exact print their largest error against the torch reference; the stand-ins' outputs
are not checked.

    python benchmarks/tools/probe_native_gpu.py --variants base stages3 no_cvt no_scale no_decode
    python benchmarks/tools/probe_native_gpu.py --variants base no_attend copy_only codes_only  # memory side
    python benchmarks/tools/probe_native_gpu.py --layout slot --variants copy_only head_major_copy base head_major
    python benchmarks/tools/probe_native_gpu.py --variants base copy_only --out benchmarks/results/probe_native_gpu.json
    python benchmarks/tools/probe_native_gpu.py --format ternary int2 --variants base no_attend copy_only  # 2-bit pools

Every (format, variant) kernel is built before the first is timed, ``--jobs`` at a time (``--build-only``:
built and cached by torch, nothing timed).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness and the attention benchmark

import bench_attention_gpu as bench  # noqa: E402
from harness.results import ResultLog  # noqa: E402
from harness.timing import copy_tbps, graph_ms  # noqa: E402

from kvcompose.ops.paged_attention import bytes_read, native, paged_decode_attention  # noqa: E402
from kvcompose.policies.policy import DEFAULT_POOL_LAYOUT, POOL_LAYOUTS  # noqa: E402

CVT = [f'"cvt.rn.f16x2.e4m3x2 %{i}, {r};\\n"' for i, r in enumerate(("l0", "l1", "h0", "h1"))]
MUL = [f'"mul.rn.f16x2 %{i}, %{i}, %5;\\n"' for i in range(4)]
KEY_PRODUCT = (
    "    for (int kk = 0; kk < S::KSTEPS; ++kk)\n"
    "      mma16816(s[j], a0[2 * kk], a1[2 * kk], a0[2 * kk + 1], a1[2 * kk + 1], kq[kk][0], kq[kk][1]);",
    "    float odd[4] = {0.f, 0.f, 0.f, 0.f};\n"
    "#pragma unroll\n"
    "    for (int kk = 0; kk < S::KSTEPS; ++kk)\n"
    "      mma16816(kk & 1 ? odd : s[j], a0[2 * kk], a1[2 * kk], a0[2 * kk + 1], a1[2 * kk + 1], kq[kk][0], "
    "kq[kk][1]);\n"
    "#pragma unroll\n"
    "    for (int c = 0; c < 4; ++c) s[j][c] += odd[c];")
RESCALE = (
    "#pragma unroll\n  for (int r = 0; r < S::VTILES; ++r) {\n    st.acc[r][0] *= alpha[0];\n"
    "    st.acc[r][1] *= alpha[1];\n    st.acc[r][2] *= alpha[0];\n    st.acc[r][3] *= alpha[1];\n  }",
    "  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {\n"
    "#pragma unroll\n  for (int r = 0; r < S::VTILES; ++r) {\n    st.acc[r][0] *= alpha[0];\n"
    "    st.acc[r][1] *= alpha[1];\n    st.acc[r][2] *= alpha[0];\n    st.acc[r][3] *= alpha[1];\n  }\n  }")
READ = ("    read_tile<F, D>(tile, base + (i % STAGES) * Stage<F, D>::BYTES, at, start + i * TILE + lane < end, gid, tig,\n"
        "                    lane, qf);\n")
ATTEND = "    attend_tile<F, D>(tile, st, qf, key_scale, gid, tig);\n"
SIDE_COPIES = ("  copy_async<SR>(stage + St::KS + SR * lane, p.ks + at, slot >= 0);\n",
               "  copy_async<SR>(stage + St::VS + SR * lane, p.vs + at, slot >= 0);\n",
               "  if ((lane & 3) == 0) copy_async<4>(stage + St::VALID + lane, p.valid + max(slot, 0), slot >= 0);\n")
HEAD_MAJOR = [
    ("  const uint32_t code = slot >= 0 ? (uint32_t)slot * p.code_stride + p.code_at : NONE;",
     "  const uint32_t code = slot >= 0 ? (uint32_t)(slot & ~15) * p.code_stride + 16 * p.code_at\n"
     "                                    + (uint32_t)(slot & 15) * Shape<F, D>::ROW : NONE;"),
    ("  const uint32_t at = (uint32_t)max(slot, 0) * p.scale_stride + p.scale_at;",
     "  const uint32_t at = (uint32_t)(max(slot, 0) & ~15) * p.scale_stride + 16 * p.scale_at\n"
     "                      + (uint32_t)(max(slot, 0) & 15) * (D / 16);")]
LAUNCH_BOUNDS = "__launch_bounds__(32, kivi_format(F) && D == 128 ? 16 : 0)"
#: variant -> [(text, replacement)] applied to the kernel's source
VARIANTS = {
    "base": [],
    "stages3": [("constexpr int STAGES = 2;", "constexpr int STAGES = 3;")],
    "stages4": [("constexpr int STAGES = 2;", "constexpr int STAGES = 4;")],
    "no_cvt": [(c, f'"mov.b32 %{i}, {{{r}, {r}}};\\n"') for c, (i, r) in
               zip(CVT, enumerate(("l0", "l1", "h0", "h1")))],
    "no_scale": [(m, "") for m in MUL],
    "no_decode": [("void fp4_word(uint32_t w, uint32_t s2, uint32_t* out) {",
                   "void fp4_word(uint32_t w, uint32_t s2, uint32_t* out) {\n  out[0] = w ^ s2; out[1] = w + s2; "
                   "out[2] = w - s2; out[3] = w | s2; return;")],
    # stand-ins for the INT and ternary decodes: a code pair becomes an fp16 pair by one logic operation
    "no_decode_int": [('  asm("fma.rn.f16x2 %0, %1, %2, %3;\\n" : "=r"(r) : "r"(code_pair<F>(w, i)), '
                       '"r"(s2), "r"(m2));', "  r = w ^ s2 ^ m2 ^ i;")],
    "no_decode_ternary": [("void e4m3x4_scaled(uint32_t e, uint32_t s2, uint32_t* out) {",
                           "void e4m3x4_scaled(uint32_t e, uint32_t s2, uint32_t* out) {\n  out[0] = e ^ s2; "
                           "out[1] = e + s2; return;")],
    # at most 113 registers, so that 18 programs fit an SM (ptxas gives 96 and spills 48 bytes)
    "lb18": [(LAUNCH_BOUNDS, "__launch_bounds__(32, 18)")],
    # ... 102 and 85 registers: 20 and 24 programs per SM
    "lb20": [(LAUNCH_BOUNDS, "__launch_bounds__(32, 20)")],
    "lb24": [(LAUNCH_BOUNDS, "__launch_bounds__(32, 24)")],
    # the key product in two independent accumulator chains of four products instead of one of eight
    "split_k": [KEY_PRODUCT],
    # the output's rescale skipped when no query head's maximum moved (every alpha is exactly 1)
    "lazy_rescale": [RESCALE],
    # stand-in: the softmax's exponentials removed
    "no_exp": [(f"fast_exp2({x} - m_safe)", f"({x} - m_safe)") for x in ("st.m[e]", "s[j][e]", "s[j][e + 2]")],
    # stand-ins for the memory side alone: the ring of copies and the fragment reads, no products or softmax
    "no_attend": [(ATTEND, "")],
    # stand-in for the compute side alone: no copies are issued, every tile is computed from whatever its stage
    # holds (the waits, fragment reads, decode, products and softmax stay)
    "no_copy": [(ISSUE, "") for ISSUE in (
        "    if (i < tiles) issue_tile<F, D>(base + i * Stage<F, D>::BYTES, slot, p, lane, at.copy);\n",
        "    if (ahead < tiles) issue_tile<F, D>(base + (ahead % STAGES) * Stage<F, D>::BYTES, slot, p, lane, "
        "at.copy);\n")],
    # ... the ring of copies alone
    "copy_only": [(READ, ""), (ATTEND, "")],
    # ... the copies of the code rows alone (no scales, no validity)
    "codes_only": [(READ, ""), (ATTEND, ""), *[(line, "") for line in SIDE_COPIES]],
    # ... the ring of copies alone with two or three tiles in flight per program instead of one
    "copy_only_3": [(READ, ""), (ATTEND, ""), ("constexpr int STAGES = 2;", "constexpr int STAGES = 3;")],
    "copy_only_4": [(READ, ""), (ATTEND, ""), ("constexpr int STAGES = 2;", "constexpr int STAGES = 4;")],
    # stand-ins: the pools read as if each 16-slot block kept a head's codes and scales together (head
    # major: [block, head, slot, bytes]), so a program's reads of one block are contiguous
    "head_major": HEAD_MAJOR,
    "head_major_copy": [(READ, ""), (ATTEND, ""), *HEAD_MAJOR],
}
#: variants whose outputs are exact (the rest replace part of the decode by a stand-in)
EXACT = {"base", "stages3", "stages4", "lb18", "lb20", "lb24", "split_k", "lazy_rescale"}


#: variants that stand in for part of one decode, and the formats whose kernels they change
DECODE_STAND_INS = {**dict.fromkeys(("no_cvt", "no_scale", "no_decode"), ("nvfp4",)),
                    "no_decode_int": ("int4", "int2", "kivi4", "kivi2"), "no_decode_ternary": ("ternary",)}


def only(source: str, fmt: str) -> str:
    """``source`` with its launchers reduced to one kernel: format ``fmt`` (a key of ``native.FORMATS``),
    bf16 queries, head dim 128 (one of 18 kernels: a fraction of the build time)."""
    name = fmt.upper()
    launch = (f'  TORCH_CHECK(fmt == {name} && D == 128 && bf16, "probe: {fmt}, bf16, head dim 128 only");\n'
              f"  launch<{name}, 128, __nv_bfloat16>(q, part, lse, tables, valid, kc, ks, khs, vc, vs, vhs, km, vm, "
              "extents, block_size, per_split, n_splits, first, total, qk_scale, head_rows);\n")
    source, launches = re.subn(r"(head_rows\)\n)  if \(fmt ==.*?(#undef KVC_LAUNCH)",
                               lambda m: m.group(1) + launch + m.group(2), source, flags=re.S)
    resident = f"  return resident<{name}, 128, __nv_bfloat16>();\n"
    source, residents = re.subn(r"(#define KVC_RESIDENT\(FMT, DIM\)[^\n]*\n).*?(#undef KVC_RESIDENT)",
                                lambda m: m.group(1) + resident + m.group(2), source, flags=re.S)
    if (launches, residents) != (1, 1):
        raise SystemExit(f"{native.SOURCE.name}: its launchers' dispatch was not found (the probe reduces it to one "
                         "kernel)")
    return source


def build(name: str, fmt: str = "nvfp4", kernel_source: Path = native.SOURCE):
    from torch.utils import cpp_extension

    source = kernel_source.read_text()
    for old, new in VARIANTS[name]:
        if old not in source:
            raise SystemExit(f"variant {name}: {old!r} not found in {native.SOURCE.name}")
        source = source.replace(old, new)
    source = only(source, fmt)
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]  # sources differing in anything build apart
    return cpp_extension.load_inline(name=f"kvcompose_probe_{fmt}_{name}_{digest}", cpp_sources=native._DECLARATIONS,
                                     cuda_sources=source, functions=["packed_partial", "packed_resident"],
                                     extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--format", nargs="+", default=["nvfp4"], choices=list(native.FORMATS),
                   help="the pools' formats (the attention benchmark's rows of those names), bf16 queries, "
                        "head dim 128; one run per format")
    p.add_argument("--shapes", nargs="*", default=["16x8192x128", "64x4096x128", "256x1024x128"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--jobs", type=int, default=8, help="kernels built at once (each build is one nvcc process)")
    p.add_argument("--source", type=Path, default=native.SOURCE,
                   help="the kernel source the variants change (default: the package's; another version of "
                        "native_packed.cu times against it in the same process)")
    p.add_argument("--build-only", action="store_true",
                   help="build the kernels into torch's extension cache and stop (a later run loads them)")
    p.add_argument("--layout", choices=list(POOL_LAYOUTS), default=DEFAULT_POOL_LAYOUT,
                   help="the pools' (slot, head) row order (Policy.pool_layout); the head_major* stand-ins need slot")
    p.add_argument("--out", default=None, help="history file the runs are added to (default: stdout only)")
    args = p.parse_args(argv)
    for name in args.variants:
        formats = DECODE_STAND_INS.get(name, args.format)
        if set(args.format) - set(formats):
            p.error(f"variant {name} stands in for the decode of {', '.join(formats)} pools; give --format among "
                    f"them (got --format {' '.join(args.format)})")
    if any(not s.endswith("x128") for s in args.shapes):
        p.error(f"the probe compiles head dim 128 only; got --shapes {' '.join(args.shapes)}")
    stand_ins = [v for v in args.variants if v.startswith("head_major")]
    if stand_ins and args.layout != "slot":
        p.error(f"variants {', '.join(stand_ins)} read slot-major pools at head-major addresses; "
                f"give --layout slot (got --layout {args.layout})")
    bench.LAYOUT = args.layout
    kernels = [(fmt, name) for fmt in args.format for name in args.variants]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        modules = dict(zip(kernels, pool.map(lambda k: build(k[1], k[0], args.source), kernels)))
    print(f"built {len(modules)} kernels", flush=True)
    if args.build_only:
        return 0
    copy = copy_tbps("cuda")
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    for fmt in args.format:
        probe(fmt, args, shapes, modules, copy)
    return 0


def probe(fmt: str, args, shapes, modules: dict, copy: float) -> None:
    """Times every variant of format ``fmt``'s kernel at ``shapes``; one history entry per format."""
    log = ResultLog(args.out) if args.out else None
    data, rows = {}, []
    for b, l, d in shapes:
        q = torch.randn(b, bench.Q_HEADS, 1, d, device="cuda", dtype=torch.bfloat16)
        sources = bench.build(fmt, b, l, "cuda", d)
        data[(b, l, d)] = (q, sources, bytes_read(sources, q))
    for name in args.variants:
        native._STATE[0] = (modules[(fmt, name)], f"probe variant {name}")
        native.resident_programs.cache_clear()
        cells = []
        for (b, l, d), (q, sources, nbytes) in data.items():
            ms = graph_ms(lambda: paged_decode_attention(q, sources, d ** -0.5, backend="cuda"), args.repeats)
            programs = native.resident_programs(0, d, True, fmt)
            rows.append({"variant": name, "exact": name in EXACT, "batch": b, "tokens": l, "head_dim": d, "ms": ms,
                         "bytes": nbytes, "fraction_of_copy": nbytes / ms / 1e9 / copy, "programs_per_sm": programs})
            cells.append(f"{b}x{l}x{d}={ms * 1e3:.1f}us {nbytes / ms / 1e9 / copy:.0%}/p{programs}")
        error = ""
        if name in EXACT:
            q, sources, _ = next(iter(data.values()))
            error = f"  max abs error {bench.check(q, sources, 'cuda'):.2e}"
        print(f"{fmt:8s} {name:10s} " + "  ".join(cells) + error, flush=True)
        if log is not None:  # after every variant: a run cut short keeps what it measured
            done = args.variants[:args.variants.index(name) + 1]
            run = {"benchmark": "CUDA kernel variants", "format": fmt, "copy_tb_per_s": copy,
                   "source_sha256": hashlib.sha256(args.source.read_bytes()).hexdigest(),
                   "repeats": args.repeats, "layout": args.layout,
                   "variants": {n: VARIANTS[n] for n in done}, "results": rows}
            print(f"wrote {log.save(run)}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
