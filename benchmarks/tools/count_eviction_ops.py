"""How many operators and kernel launches a scheduled eviction step runs, by line of kvcompose.

At small shapes a replayed eviction step costs its launches (a few microseconds each inside a
CUDA graph), not its bytes, so the count per call site says what to cut. This tool decodes
without graphs and, inside every layer's scheduled ``compress``, counts each torch operator that
computes (views, allocations and conversions that do not launch are left out) and each Triton
launch, at the innermost line of kvcompose that issued it. Counts are per layer and eviction step.
The buffer flushes of static decode (a full group of the recent buffer encoded into the pools,
which an eviction step also runs) are counted the same way, per layer and flush.

With ``--smoke`` it runs a tiny model on the CPU with the Triton kernels interpreted, the
per-step ops take their kernels inside the counted calls, as they do on a GPU (on CPU they
would pick their torch references), and the pools keep no decoded copy (on CPU they would), so
the count follows the GPU's code path. A GPU runs
some operators (sorts, scans) as several launches; ``profile_eviction_step.py`` counts the GPU's
kernels themselves.

    python benchmarks/tools/count_eviction_ops.py --smoke --policies thinkv,rkv
    python benchmarks/tools/count_eviction_ops.py --policies thinkv --batch 16 --prompt 512 --new-tokens 700
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # triton.jit reads it when the kernels' modules are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_e2e_gpu
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the eviction profiler's arguments

from bench_e2e_gpu import make_policy  # noqa: E402
from profile_eviction_step import workload, workload_parser  # noqa: E402

from kvcompose.hf.static import fast_generate  # noqa: E402
from kvcompose.runtime import compression, layer as layer_runtime  # noqa: E402
from kvcompose.speed import random_prompts  # noqa: E402

#: Operators that launch nothing (views, metadata, allocation without a fill).
QUIET = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "expand_as",
         "t", "transpose", "permute", "reshape", "alias", "unbind", "split", "chunk", "narrow", "detach",
         "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resolve_conj",
         "resolve_neg", "view_as", "unflatten", "flatten", "movedim", "diagonal", "_local_scalar_dense",
         "is_nonzero", "result_type", "set_", "_reshape_alias", "view_as_real", "view_as_complex", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
         "contiguous", "to"}  # a copy they make shows as clone or _to_copy
#: The modules of the ops that run every decode step (``step_kernel_runs`` picks their kernels on CUDA only).
STEP_OPS = ("scatter_slots", "compact_rows", "evict_one", "claim_slots", "pack_blocks", "paged_attention.attention",
            "rotate_rows", "redundancy", "append_token")


def call_site() -> str:
    """The innermost line of kvcompose on the stack, as ``path/in/package.py:line function``."""
    for frame in reversed(traceback.extract_stack()):
        if "kvcompose" in frame.filename and f"{os.sep}src{os.sep}" in frame.filename:
            return f"{frame.filename.rsplit('kvcompose' + os.sep, 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class OpTally(TorchDispatchMode):
    """Operators and Triton launches by call site while ``counting``; a launch's own operators
    (the interpreter's copies) are not counted. ``calls``: the counted calls (a layer's compression
    or flush each)."""

    def __init__(self):
        super().__init__()
        self.sites, self.ops = Counter(), Counter()
        self.counting = False
        self.calls = 0

    def note(self, name: str) -> None:
        self.sites[call_site()] += 1
        self.ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.counting and name not in QUIET:
            self.note(name)
        return func(*args, **(kwargs or {}))

    def run(self, fn, *args):
        """``fn(*args)``, counted (as one call)."""
        self.calls += 1
        self.counting = True
        try:
            with self:
                return fn(*args)
        finally:
            self.counting = False


@contextmanager
def counting(tally: OpTally, flushes: OpTally, force_kernels: bool):
    """Count inside every scheduled ``compress`` (into ``tally``) and every buffer flush of static
    decode (into ``flushes``) while the block runs (``force_kernels``: the per-step ops take their
    Triton kernels on CPU tensors, interpreted)."""
    from kvcompose.ops import dispatch
    from kvcompose.paging.store import LayerStore
    from kvcompose.paging.store_static import StoreStatic

    compress, flush, make_store = compression.compress, StoreStatic._flush_full_rows, LayerStore.__init__
    launches = {}
    patched_dispatch = []

    def compress_counted(layer, view=None, scheduled=False):
        return tally.run(compress, layer, view, scheduled) if scheduled else compress(layer, view, scheduled)

    def flush_counted(store):
        return flushes.run(flush, store)

    def store_as_on_gpu(store, *args, decoded_copy=None, **kwargs):
        # on the CPU, pools of quantized formats keep a decoded copy (scratch of the torch decode
        # attention) that every flush writes; a GPU's pools do not
        make_store(store, *args, decoded_copy=False, **kwargs)

    def counting_now():
        return next((t for t in (tally, flushes) if t.counting), None)

    def launch_counted(run):
        def launch(kernel, *args, **kwargs):
            counter = counting_now()
            if counter is not None:
                counter.note(f"triton {getattr(kernel, '__name__', type(kernel).__name__)}")
                counter.counting = False  # the interpreter's own tensor work is not the step's
            try:
                return run(kernel, *args, **kwargs)
            finally:
                if counter is not None:
                    counter.counting = True
        return launch

    def kernels_run(x, kernel, backend, fits=True):  # in the counted calls only: the CPU decodes on torch
        if counting_now() is not None:
            return backend != "torch" and fits
        return dispatch.step_kernel_runs(x, kernel, backend, fits)

    from kvcompose.ops import compact_rows, scatter_slots  # their kernels: the kernel classes to count launches of

    for kernel in (scatter_slots._copy_kernel, compact_rows._compact_rows_kernel):
        cls = type(kernel)
        if cls not in launches:
            launches[cls] = cls.run
            cls.run = launch_counted(cls.run)
    if force_kernels:
        LayerStore.__init__ = store_as_on_gpu
        for name in STEP_OPS:
            module = importlib.import_module(f"kvcompose.ops.{name}")
            if getattr(module, "step_kernel_runs", None) is dispatch.step_kernel_runs:
                patched_dispatch.append(module)
                module.step_kernel_runs = kernels_run
    layer_runtime.compress = compress_counted
    StoreStatic._flush_full_rows = flush_counted
    try:
        yield
    finally:
        layer_runtime.compress = compress
        StoreStatic._flush_full_rows = flush
        LayerStore.__init__ = make_store
        for cls, run in launches.items():
            cls.run = run
        for module in patched_dispatch:
            module.step_kernel_runs = dispatch.step_kernel_runs


def per_call(tally: OpTally, top: int) -> dict:
    """What ``tally`` counted, per counted call: in all, by call site and by operator."""
    per = max(tally.calls, 1)
    return {"per_call": sum(tally.sites.values()) / per,
            "sites": [(s, n / per) for s, n in tally.sites.most_common(top)],
            "ops": [(o, n / per) for o, n in tally.ops.most_common(top)]}


def count_policy(model, name: str, args) -> dict:
    """One policy: operators and launches per layer and eviction step, and per layer and buffer flush,
    by call site and by operator."""
    device = "cpu" if args.smoke else "cuda"
    policy = make_policy(name, args.budget, args.smoke)
    ids, mask = random_prompts(model.config.vocab_size, args.batch, args.prompt, device)
    if not args.smoke:
        fast_generate(model, policy.make_cache(model), ids, mask, 8, graphs=False)  # compile every kernel first
    tally, flushes = OpTally(), OpTally()
    with counting(tally, flushes, force_kernels=args.smoke):
        fast_generate(model, policy.make_cache(model), ids, mask, args.new_tokens, graphs=False)
    layers = model.config.num_hidden_layers  # every layer compresses (and flushes) once per step that does
    return {"policy": name, "eviction_steps": tally.calls / layers, "evictions": per_call(tally, args.top),
            "flushes": flushes.calls / layers, "flush": per_call(flushes, args.top)}


def report(record: dict, what: str, counted: str, step: str, steps: str) -> None:
    print(f"{record['policy']}: {record[counted]:.0f} {steps}, {record[what]['per_call']:.1f} operators and "
          f"launches per layer and {step}", flush=True)
    for site, n in record[what]["sites"]:
        print(f"  {n:7.1f}  {site}")
    print("  by operator:")
    for op, n in record[what]["ops"]:
        print(f"  {n:7.1f}  {op}")


def main(argv=None) -> int:
    args, model = workload(workload_parser(__doc__, 30, "call sites and operators shown",
                                           "tiny model on the CPU, kernels interpreted"), argv)
    for name in [p for p in args.policies.split(",") if p]:
        record = count_policy(model, name, args)
        report(record, "evictions", "eviction_steps", "eviction step", "eviction steps")
        report(record, "flush", "flushes", "buffer flush", "buffer flushes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
