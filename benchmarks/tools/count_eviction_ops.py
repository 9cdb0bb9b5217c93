"""How many operators and kernel launches a scheduled eviction step runs, by line of kvcompose.

At small shapes a replayed eviction step costs its launches (a few microseconds each inside a
CUDA graph), not its bytes, so the count per call site says what to cut. This tool decodes
without graphs and, inside every layer's scheduled ``compress``, counts each torch operator that
computes (views, allocations and conversions that do not launch are left out) and each Triton
launch, at the innermost line of kvcompose that issued it. Counts are per layer and eviction step.

With ``--smoke`` it runs a tiny model on the CPU with the Triton kernels interpreted, and the
per-step ops take their kernels inside the counted compressions, as they do on a GPU (on CPU
they would pick their torch references), so the count follows the GPU's code path. A GPU runs
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
    (the interpreter's copies) are not counted."""

    def __init__(self):
        super().__init__()
        self.sites, self.ops = Counter(), Counter()
        self.counting = False
        self.compressions = 0

    def note(self, name: str) -> None:
        self.sites[call_site()] += 1
        self.ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.counting and name not in QUIET:
            self.note(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(tally: OpTally, force_kernels: bool):
    """Count inside every scheduled ``compress`` while the block runs (``force_kernels``: the
    per-step ops take their Triton kernels on CPU tensors, interpreted)."""
    from kvcompose.ops import dispatch

    compress = compression.compress
    launches = {}
    patched_dispatch = []

    def compress_counted(layer, view=None, scheduled=False):
        if not scheduled:
            return compress(layer, view, scheduled)
        tally.compressions += 1
        tally.counting = True
        try:
            with tally:
                return compress(layer, view, scheduled)
        finally:
            tally.counting = False

    def launch_counted(run):
        def launch(kernel, *args, **kwargs):
            counting_now = tally.counting
            if counting_now:
                tally.note(f"triton {getattr(kernel, '__name__', type(kernel).__name__)}")
            tally.counting = False  # the interpreter's own tensor work is not the step's
            try:
                return run(kernel, *args, **kwargs)
            finally:
                tally.counting = counting_now
        return launch

    def kernels_run(x, kernel, backend, fits=True):  # in the counted steps only: the CPU decodes on torch
        return backend != "torch" and fits if tally.counting else dispatch.step_kernel_runs(x, kernel, backend, fits)

    from kvcompose.ops import compact_rows, scatter_slots  # their kernels: the kernel classes to count launches of

    for kernel in (scatter_slots._copy_kernel, compact_rows._compact_rows_kernel):
        cls = type(kernel)
        if cls not in launches:
            launches[cls] = cls.run
            cls.run = launch_counted(cls.run)
    if force_kernels:
        for name in STEP_OPS:
            module = importlib.import_module(f"kvcompose.ops.{name}")
            if getattr(module, "step_kernel_runs", None) is dispatch.step_kernel_runs:
                patched_dispatch.append(module)
                module.step_kernel_runs = kernels_run
    layer_runtime.compress = compress_counted
    try:
        yield
    finally:
        layer_runtime.compress = compress
        for cls, run in launches.items():
            cls.run = run
        for module in patched_dispatch:
            module.step_kernel_runs = dispatch.step_kernel_runs


def count_policy(model, name: str, args) -> dict:
    """One policy: operators and launches per layer and eviction step, by call site and by operator."""
    device = "cpu" if args.smoke else "cuda"
    policy = make_policy(name, args.budget, args.smoke)
    ids, mask = random_prompts(model.config.vocab_size, args.batch, args.prompt, device)
    if not args.smoke:
        fast_generate(model, policy.make_cache(model), ids, mask, 8, graphs=False)  # compile every kernel first
    tally = OpTally()
    with counting(tally, force_kernels=args.smoke):
        fast_generate(model, policy.make_cache(model), ids, mask, args.new_tokens, graphs=False)
    steps = tally.compressions / model.config.num_hidden_layers  # every layer compresses once per eviction step
    per = max(tally.compressions, 1)
    return {"policy": name, "eviction_steps": steps, "per_layer_step": sum(tally.sites.values()) / per,
            "sites": [(s, n / per) for s, n in tally.sites.most_common(args.top)],
            "ops": [(o, n / per) for o, n in tally.ops.most_common(args.top)]}


def main(argv=None) -> int:
    args, model = workload(workload_parser(__doc__, 30, "call sites and operators shown",
                                           "tiny model on the CPU, kernels interpreted"), argv)
    for name in [p for p in args.policies.split(",") if p]:
        record = count_policy(model, name, args)
        print(f"{name}: {record['eviction_steps']:.0f} eviction steps, {record['per_layer_step']:.1f} operators and "
              "launches per layer and eviction step", flush=True)
        for site, n in record["sites"]:
            print(f"  {n:7.1f}  {site}")
        print("  by operator:")
        for op, n in record["ops"]:
            print(f"  {n:7.1f}  {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
