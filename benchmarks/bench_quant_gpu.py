"""Quantize / dequantize throughput of every storage format at Llama-3-8B KV shapes.

Run (from the repository root, kvcompose installed or ``PYTHONPATH=src``)::

    python benchmarks/bench_quant_gpu.py --out benchmarks/results/quant_gpu.json
    TRITON_INTERPRET=1 python benchmarks/bench_quant_gpu.py --smoke --out /tmp/quant_smoke.json   # CPU, seconds

One call quantizes one layer's keys (or values) of a whole batch: ``[N, 8, 128]``
bf16 with N = 32768 and 262144 tokens (batch x context), through the registered
quantizers exactly as the store calls them, and decodes the result back to bf16.

- **quantize, store path**: ``quantizer.quantize(x, role=..., head_scale=s)`` with
  ``s`` of shape ``[N, H]``, one scale per token and head, as the store's codec gives
  it (each token's sequence scale times the format's unit scale; here twice the scale
  the data itself would get, i.e. ``scale_headroom=2``, so nothing saturates). The
  dequantize rows decode these packs, per-token scales included.
- **quantize, default path**: ``quantizer.quantize(x, role=...)``: the per-head scale
  is computed from ``x`` first, so ``x`` is read twice and its bytes count twice. INT
  has no per-head scale, so it has one quantize path, reported as ``store``.
- **dequantize**: ``quantizer.dequantize(packed, torch.bfloat16)``.

Two timings per row, each the median of ``--repeats`` after ``--warmup``, cycling
through enough input copies (at least 4 x L2) that the L2 cache cannot serve a call
from the previous one:

- **kernel** (``ms``, ``tbps``, ``frac_copy``): the op's device time. One call per
  input copy is captured in a CUDA graph (quantize with a caller-owned error flag,
  ``flags=``, so nothing synchronizes; the flag is checked after timing) and the graph
  is replayed; time per call = replay time / calls. This is how a serving loop runs
  decode, and it is what the 70% target is judged on.
- **eager call** (``call_ms``, ``call_frac_copy``): CUDA events around plain Python
  calls issued back to back, host-side checks, launches and (quantize without
  ``flags``) the one host synchronization that reads the error flag included. At 32k
  tokens this is dominated by Python and launch overhead, not by the GPU.

Effective bandwidth counts the bytes the op moves: bf16 input (twice on the default
path) + packed output (every packed tensor) for quantize, packed input + bf16 output
for dequantize. It is reported in TB/s and as a fraction of the device-to-device copy
bandwidth measured in the same run (``dst.copy_(src)`` on 2 GiB, bytes read + written,
after a warm-up that brings the clocks up). The target is 70% of copy bandwidth for
every format, op and path.

Before timing, each format's Triton result is compared with the torch reference on
the first 4096 tokens (``matches_reference``; bit for bit). ``--smoke`` runs tiny
shapes on any device (CPU needs ``TRITON_INTERPRET=1`` for the Triton kernels,
otherwise the torch reference runs); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.results import ResultLog, result_path
from harness.table import format_table
from harness.timing import call_times_ms, capture_graph, copy_times_ms, sync
from kvcompose import registry
from kvcompose.ops.checks import flag_bits, new_flags

TARGET = 0.70  # fraction of copy bandwidth asked for

# label -> (quantizer spec, role)
FORMATS: dict[str, tuple[dict, str | None]] = {
    "fp8": ({"name": "fp8"}, None),
    "nvfp4": ({"name": "nvfp4"}, None),
    "ternary": ({"name": "ternary"}, None),
    "int8": ({"name": "int", "bits": 8}, None),
    "int4": ({"name": "int", "bits": 4}, None),
    "int2": ({"name": "int", "bits": 2}, None),
    "kivi4-keys": ({"name": "int", "bits": 4, "layout": "kivi", "token_group": 32}, "key"),
    "kivi4-values": ({"name": "int", "bits": 4, "layout": "kivi", "token_group": 32}, "value"),
    "kivi2-keys": ({"name": "int", "bits": 2, "layout": "kivi", "token_group": 32}, "key"),
    "kivi2-values": ({"name": "int", "bits": 2, "layout": "kivi", "token_group": 32}, "value"),
}


@dataclass(frozen=True)
class Config:
    tokens: tuple[int, ...] = (32768, 262144)
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    formats: tuple[str, ...] = tuple(FORMATS)
    warmup: int = 3
    repeats: int = 20
    copy_bytes: int = 2 * 2**30
    check_tokens: int = 4096
    min_rotate_bytes: int = 256 * 2**20  # cycle inputs until this many bytes (> 4x the H100/H200 L2)
    time_budget_s: float = 200.0


SMOKE = Config(tokens=(16, 40), kv_heads=2, head_dim=32, warmup=0, repeats=1, copy_bytes=2**16, check_tokens=16,
               min_rotate_bytes=0, time_budget_s=1e9)


# ------------------------------------------------------------------------- timing
def time_calls(fn, inputs: list, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls ``fn(inputs[i % len(inputs)])``, issued back to back."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    sync(device)
    return call_times_ms(lambda i: fn(inputs[i % len(inputs)]), repeats, device, back_to_back=True)


def summary(times: list[float], nbytes: int, copy_tbps: float | None) -> dict:
    med = statistics.median(times)
    tbps = nbytes / (med * 1e-3) / 1e12
    out = {"ms": med, "ms_min": min(times), "ms_max": max(times), "repeats": len(times), "bytes": nbytes,
           "tbps": tbps}
    if copy_tbps:
        out["frac_copy"] = tbps / copy_tbps
        out["meets_target"] = out["frac_copy"] >= TARGET
    return out


def time_graph(fn, inputs: list, device: torch.device, warmup: int, repeats: int) -> list[float] | None:
    """Milliseconds per call of ``fn`` over ``inputs``, from replays of a CUDA graph holding one call per input.

    None off CUDA. ``fn`` must not synchronize (quantize with ``flags=``).
    """
    if device.type != "cuda":
        return None

    def each_input():
        for x in inputs:
            fn(x)

    graph = capture_graph(each_input, each_input, device)
    for _ in range(max(1, warmup)):
        graph.replay()
    out = [t / len(inputs) for t in call_times_ms(lambda _: graph.replay(), repeats, device, back_to_back=True)]
    del graph
    return out


def timing(kernel: list[float] | None, call: list[float], nbytes: int, copy_tbps: float | None) -> dict:
    """Row fields: the kernel (graph) timing as the headline, the eager call beside it (kernel = call off CUDA)."""
    head = summary(kernel if kernel is not None else call, nbytes, copy_tbps)
    eager = summary(call, nbytes, copy_tbps)
    return {**head, "timing": "cuda-graph" if kernel is not None else "eager", "call_ms": eager["ms"],
            "call_tbps": eager["tbps"], "call_frac_copy": eager.get("frac_copy")}


def measure_copy(device: torch.device, cfg: Config) -> dict:
    """Device-to-device copy bandwidth (the harness's one reference), bytes read + written."""
    times, moved = copy_times_ms(device, cfg.copy_bytes, cfg.warmup, cfg.repeats)
    return summary(times, moved, None)


# ---------------------------------------------------------------------- formats
def packed_nbytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.tensors().values())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def check_reference(q, role, x: torch.Tensor, head_scale) -> bool:
    """Triton result == torch reference, bit for bit, for quantize (both paths) and dequantize."""
    ok = True
    for hs in ((None, head_scale) if head_scale is not None else (None,)):
        tri = q.quantize(x, role=role, head_scale=hs, backend="triton")
        ref = q.quantize(x, role=role, head_scale=hs, backend="torch")
        ok &= all(same_bits(a, b) for a, b in zip(tri.tensors().values(), ref.tensors().values()))
        ok &= same_bits(q.dequantize(tri, torch.bfloat16, backend="triton"),
                        q.dequantize(ref, torch.bfloat16, backend="torch"))
    return bool(ok)


def bench_format(label: str, n: int, device: torch.device, cfg: Config, copy_tbps: float | None,
                 gen: torch.Generator) -> list[dict]:
    spec, role = FORMATS[label]
    q = registry.build("quantizer", spec)
    shape = (n, cfg.kv_heads, cfg.head_dim)
    one = torch.randn(shape, device=device, dtype=cfg.dtype, generator=gen)
    copies = max(1, -(-cfg.min_rotate_bytes // (one.numel() * one.element_size())))
    xs = [one] + [torch.randn(shape, device=device, dtype=cfg.dtype, generator=gen) for _ in range(copies - 1)]
    probe = q.quantize(one, role=role)
    # the store's codec passes one scale per token and head (scale_headroom = 2)
    head_scale = None if probe.head_scale is None else (probe.head_scale * 2.0).expand(n, -1).contiguous()
    backend = "triton" if device.type == "cuda" or _interpreted() else None
    check_scale = None if head_scale is None else head_scale[: cfg.check_tokens]
    matches = check_reference(q, role, one[: cfg.check_tokens], check_scale) if backend == "triton" else None

    in_bytes = one.numel() * one.element_size()
    rows = []
    base = {"format": label, "spec": spec, "role": role, "tokens": n, "shape": list(shape),
            "dtype": str(cfg.dtype).removeprefix("torch."), "bits_per_value": q.bits_per_value_for(cfg.head_dim),
            "matches_reference": matches}
    paths = [("store", head_scale)] + ([("default", None)] if head_scale is not None else [])
    flags = new_flags(device)
    packed_bytes = packed_nbytes(q.quantize(one, role=role, head_scale=head_scale))
    for path, hs in paths:
        call = time_calls(lambda x: q.quantize(x, role=role, head_scale=hs), xs, device, cfg.warmup, cfg.repeats)
        kernel = time_graph(lambda x: q.quantize(x, role=role, head_scale=hs, flags=flags), xs, device,
                            cfg.warmup, cfg.repeats)
        reads = 2 if path == "default" else 1
        rows.append({**base, "op": "quantize", "path": path,
                     **timing(kernel, call, reads * in_bytes + packed_bytes, copy_tbps)})
    if device.type == "cuda" and flag_bits(flags):
        raise RuntimeError(f"{label}: the quantize kernels flagged the benchmark input as bad")
    packs = [q.quantize(x, role=role, head_scale=head_scale) for x in xs]
    call = time_calls(lambda p: q.dequantize(p, torch.bfloat16), packs, device, cfg.warmup, cfg.repeats)
    kernel = time_graph(lambda p: q.dequantize(p, torch.bfloat16), packs, device, cfg.warmup, cfg.repeats)
    rows.append({**base, "op": "dequantize", "path": "store",
                 **timing(kernel, call, packed_bytes + in_bytes, copy_tbps)})
    del xs, packs, one
    return rows


def _interpreted() -> bool:
    from kvcompose.ops.quant_fp8 import _fp8_quantize_kernel
    from kvcompose.ops.triton_shim import interpreted

    return interpreted(_fp8_quantize_kernel)


# --------------------------------------------------------------------------- run
def progress_line(row: dict) -> str:
    frac = f"{100 * row['frac_copy']:5.1f}% of copy" if "frac_copy" in row else ""
    return (f"{row['format']:>13} N={row['tokens']:<7} {row['op']:>10} {row['path']:>7}: "
            f"{row['ms']:8.3f} ms {row['tbps']:6.2f} TB/s {frac} (eager call {row['call_ms']:.3f} ms)")


def run(cfg: Config, device: torch.device) -> tuple[dict, list[dict]]:
    start = time.perf_counter()
    copy = measure_copy(device, cfg)
    print(f"copy: {copy['ms']:.3f} ms for {copy['bytes'] / 2**30:.2f} GiB read+written = {copy['tbps']:.2f} TB/s",
          flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for n in cfg.tokens:
        for label in cfg.formats:
            if time.perf_counter() - start > cfg.time_budget_s:
                results.append({"format": label, "tokens": n, "status": "skipped"})
                print(f"{label:>13} N={n}: skipped (time budget)", flush=True)
                continue
            try:
                rows = bench_format(label, n, device, cfg, copy["tbps"], gen)
            except Exception as exc:  # noqa: BLE001 - record and go on
                traceback.print_exc()
                results.append({"format": label, "tokens": n, "status": "error", "error": repr(exc)})
                continue
            for row in rows:
                row["status"] = "ok"
                results.append(row)
                print(progress_line(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return copy, results


def table(results: list[dict]) -> str:
    headers = ["format", "N", "op", "path", "kernel ms", "TB/s", "% copy", ">=70%", "call ms", "call % copy", "exact"]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append([r["format"], r["tokens"], "", "", r.get("status"), "", "", "", "", "", ""])
            continue
        frac = r.get("frac_copy")
        rows.append([r["format"], r["tokens"], r["op"], r["path"], f"{r['ms']:.3f}", f"{r['tbps']:.2f}",
                     "" if frac is None else f"{100 * frac:.1f}",
                     "" if frac is None else ("yes" if r["meets_target"] else "NO"),
                     f"{r['call_ms']:.3f}", "" if r["call_frac_copy"] is None else f"{100 * r['call_frac_copy']:.1f}",
                     {True: "yes", False: "NO", None: "-"}[r["matches_reference"]]])
    return format_table(headers, rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=result_path("quant_gpu"), help="history file the run is added to")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: checks the script on any device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", nargs="+", type=int)
    p.add_argument("--formats", nargs="+", choices=list(FORMATS))
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--time-budget-s", type=float)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = SMOKE if args.smoke else Config()
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in
                 (("tokens", args.tokens), ("formats", args.formats), ("repeats", args.repeats),
                  ("warmup", args.warmup), ("time_budget_s", args.time_budget_s)) if v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    device = torch.device(args.device)
    log = ResultLog(args.out)
    env = log.environment
    print(f"device {env['gpu'] or env['cpu']}; torch {env['versions']['torch']}, triton {env['versions']['triton']}",
          flush=True)
    wall = time.perf_counter()
    copy, results = run(cfg, device)
    ok = [r for r in results if r.get("status") == "ok"]
    meets = [r for r in ok if r.get("meets_target")]
    data = {
        "benchmark": "quantize/dequantize throughput per storage format",
        "smoke": args.smoke,
        "config": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"},
                   "dtype": str(cfg.dtype).removeprefix("torch."), "device": str(device)},
        "target_frac_copy": TARGET,
        "copy": copy,
        "results": results,
        "summary": {"configurations": len(ok), "meet_target": len(meets),
                    "below_target": sorted({f"{r['format']} {r['op']} {r['path']}" for r in ok
                                            if r.get("meets_target") is False}),
                    "all_match_reference": all(r["matches_reference"] is not False for r in ok)},
        "seconds": time.perf_counter() - wall,
    }
    path = log.save(data)
    print(table(results))
    print(f"copy bandwidth {copy['tbps']:.2f} TB/s; {len(meets)}/{len(ok)} configurations at >= {TARGET:.0%} of it")
    print(f"wrote {path} in {data['seconds']:.1f}s", flush=True)
    errors = [r for r in results if r.get("status") == "error"]
    return 1 if errors or not data["summary"]["all_match_reference"] else 0


if __name__ == "__main__":
    sys.exit(main())
