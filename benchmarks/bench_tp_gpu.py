"""Tensor-parallel decode: kvcompose presets at TP = 1, 2 and 4 GPUs of one host.

The model has Llama-3-8B shapes with random bf16 weights, written once as a checkpoint
(seed 0) and loaded by transformers with its tensor-parallel plan
(:func:`kvcompose.hf.load_tensor_parallel`), one ``torchrun`` per TP degree; TP = 1 runs
under torchrun too, so every degree takes the same path. Each rank decodes the same random
prompts greedily through ``fast_generate`` (static shapes, CUDA graphs) and its cache holds
the rank's KV heads; decisions that combine heads are all-reduced over the ranks inside the
captured steps.

Two measurements per (TP, policy):

- **Same batch** (``--batch``, default 64; prompt ``--prompt`` 8,192 + ``--new`` 256 new
  tokens, budget 1,024: a context of about 8.7K tokens): decode ms per step (rank 0's wall
  time from the first decode step, one-time graph work included, and its steady GPU time),
  tok/s, ``scaling_vs_tp1`` (tok/s over the same policy's at TP = 1), the per-rank floor
  (the rank's weight shards and KV bytes over the copy bandwidth measured on its GPU), and
  ``ranks_agree``: every layer of every rank holds exactly the positions rank 0 holds.
- **Fixed memory per GPU** (``--memory-gib``, default 70): the largest batch whose peak
  memory on every GPU stays under the cap for prompt 512 + 8,192 reserved new tokens, from
  probes at batch 2 and 4 (the largest peak over ranks), then timed over ``--window`` steps
  at that batch. The search stops at 1,024 rows (``batch_limit_reached`` says a record got
  there: more would fit).

    python benchmarks/bench_tp_gpu.py --smoke --tp 1,2             # tiny model, seconds
    python benchmarks/bench_tp_gpu.py --smoke --tp 1,2 --kinds same_batch   # no GPU: ranks on the CPU (gloo)
    python benchmarks/bench_tp_gpu.py --tp 1,2,4 --out benchmarks/results/tp_gpu.json

Records: ``tp``, ``policy``, ``batch``, ``ms_per_step``, ``tok_per_s``, ``scaling_vs_tp1``,
``ranks_agree``, ``gpu`` and the floor fields; the environment (GPU, versions, commit, dirty
flag) is read by the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.environment import environment  # noqa: E402
from harness.llama import llama_model  # noqa: E402
from harness.results import ResultLog  # noqa: E402
from harness.table import format_table  # noqa: E402

POLICIES = ["fullkv", "rkv", "thinkv"]
BUDGETED = {"rkv", "snapkv", "thinkv", "streamingllm"}
THINKV_CLASSIFIER = {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1, 2, 3]}
MODEL = "random Llama-3-8B shapes, bf16"
TABLE = ["kind", "tp", "policy", "batch", "ms_per_step", "steady_ms_per_step", "floor_ms_per_step", "tok_per_s",
         "scaling_vs_tp1", "ranks_agree", "peak_gib", "error"]


def make_policy(name: str, budget: int, smoke: bool):
    from kvcompose import Policy
    from kvcompose.speed import warm_up_policy

    overrides = {"budget": budget} if name in BUDGETED else {}
    if name.startswith("thinkv"):
        overrides["classifier"] = dict(THINKV_CLASSIFIER, layers=[0, 1] if smoke else [0, 1, 2, 3])
    policy = Policy.from_preset(name, **overrides)
    return warm_up_policy(policy, budget) if smoke else policy


# ------------------------------------------------------------------ one rank
def ranks_agree(cache) -> dict:
    """Whether every layer of every rank holds the positions rank 0's holds (one collective per layer)."""
    import torch.distributed as dist

    device = cache.layers[0].store.device  # the group's: NCCL on GPUs, gloo on the CPU
    same = torch.ones((), dtype=torch.int32, device=device)
    for layer in cache.layers:
        positions, valid, _ = layer.store.slot_state()
        held = torch.where(valid, positions, -1).sort(dim=1).values.contiguous()
        shape = torch.tensor(held.shape, device=device)
        first = shape.clone()
        dist.broadcast(first, src=0)
        if not torch.equal(first, shape):
            same.zero_()
            continue
        reference = held.clone()
        dist.broadcast(reference, src=0)
        if not torch.equal(reference, held):
            same.zero_()
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {"ranks_agree": bool(same.item())}


BATCH_LIMIT = 1024  # the fixed-memory search stops here (a record at it says batch_limit_reached)


def largest_batch(model, policy, prompt: int, new: int, cap_gib: float) -> int:
    """The largest batch under ``cap_gib`` on every GPU, from short runs at batch 2 and 4
    (the peak of the rank that peaks highest, so every rank picks the same batch)."""
    import gc

    import torch.distributed as dist

    from kvcompose.speed import largest_batch as fit, random_prompts, time_policy

    peaks = {}
    for b in (2, 4):
        gc.collect()
        torch.cuda.empty_cache()
        ids, mask = random_prompts(model.config.vocab_size, b, prompt, model.device)
        time_policy(model, policy, ids, mask, 2, reserve_new_tokens=new, profile=False)
        peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks[b] = peak.item()
    per_row = (peaks[4] - peaks[2]) / 2
    return fit(peaks[2] - 2 * per_row, per_row, 0.97 * cap_gib * 2**30, limit=BATCH_LIMIT)


def worker(args) -> None:
    import torch.distributed as dist

    from kvcompose.hf import load_tensor_parallel
    from kvcompose.speed import add_floor, copy_tbps, random_prompts, time_policy

    cuda = torch.cuda.is_available()
    model = load_tensor_parallel(args.checkpoint, dtype=torch.bfloat16 if cuda else torch.float32)
    model.generation_config.eos_token_id = None
    tp, rank = dist.get_world_size(), dist.get_rank()
    copy = copy_tbps(model.device, None if cuda else 2**28)  # a CPU check copies less
    _empty_cache()
    rows = []
    for name in [p for p in args.policies.split(",") if p]:
        policy = make_policy(name, args.budget, args.smoke)
        for kind in args.kinds.split(","):
            row = {"kind": kind, "tp": tp, "policy": name, "copy_tbps": copy}
            try:
                if kind == "same_batch":
                    ids, mask = random_prompts(model.config.vocab_size, args.batch, args.prompt, model.device)
                    row.update(time_policy(model, policy, ids, mask, args.new, inspect=ranks_agree),
                               prompt=args.prompt)
                else:
                    batch = largest_batch(model, policy, args.fixed_prompt, args.fixed_new, args.memory_gib)
                    ids, mask = random_prompts(model.config.vocab_size, batch, args.fixed_prompt, model.device)
                    row.update(time_policy(model, policy, ids, mask, args.window, reserve_new_tokens=args.fixed_new,
                                           inspect=ranks_agree),
                               prompt=args.fixed_prompt, reserved_new_tokens=args.fixed_new,
                               memory_cap_gib=args.memory_gib, batch_limit_reached=batch >= BATCH_LIMIT)
                    peak = torch.tensor(row["peak_gib"], device="cuda")
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    row.update(peak_gib_max_rank=peak.item(), over_cap=peak.item() > args.memory_gib)
            except Exception as exc:  # noqa: BLE001  (recorded; the other runs go on)
                import traceback

                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(add_floor(row, copy))
            _empty_cache()
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        Path(args.records).write_text(json.dumps(rows))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # the records are written; skip tearing down the captured graphs and communicators


# ------------------------------------------------------------------ the driver
def write_checkpoint(path: Path, smoke: bool, device: str) -> None:
    """The random model, saved once (seed 0) for every TP degree to load."""
    if (path / "config.json").exists():
        return
    model = llama_model(smoke, device, dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa")  # the loader sets kvcompose's
    model.save_pretrained(path)
    del model
    _empty_cache()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_degree(tp: int, args, checkpoint: Path, records: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
               __file__, "--worker", "--checkpoint", str(checkpoint), "--records", str(records)]
    for key, value in settings(args).items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    if args.smoke:
        command.append("--smoke")
    try:
        failure = subprocess.run(command, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        failure = f"torchrun ran past {args.timeout} s"
    if records.exists():  # written once every run of this degree is done
        return json.loads(records.read_text())
    return [{"tp": tp, "policy": p, "kind": k, "error": f"torchrun failed ({failure})"}
            for p in args.policies.split(",") for k in args.kinds.split(",")]


def settings(args) -> dict:
    """What a degree's workers measure; a resumed run must measure the same."""
    keys = ("policies", "kinds", "batch", "prompt", "new", "budget", "memory_gib", "window", "fixed_prompt",
            "fixed_new")
    return {key: getattr(args, key) for key in keys}


def add_scaling(rows: list[dict]) -> None:
    """``scaling_vs_tp1``: tok/s over that of the same policy and kind at TP = 1."""
    base = {(r["policy"], r["kind"]): r["tok_per_s"] for r in rows if r["tp"] == 1 and r.get("tok_per_s")}
    for r in rows:
        if r.get("tok_per_s") and (r["policy"], r["kind"]) in base:
            r["scaling_vs_tp1"] = r["tok_per_s"] / base[(r["policy"], r["kind"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths (checks the script)")
    ap.add_argument("--tp", default="1,2,4", help="tensor-parallel degrees, each a torchrun of that many GPUs")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--kinds", default="same_batch,fixed_memory", help="same_batch, fixed_memory or both")
    ap.add_argument("--batch", type=int, default=64, help="same-batch rows (fullkv at TP = 1 needs about 86 GB)")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=256, help="new tokens of the same-batch run (its timed window)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--memory-gib", type=float, default=70.0, help="fixed memory: the cap per GPU, weights included")
    ap.add_argument("--fixed-prompt", type=int, default=512)
    ap.add_argument("--fixed-new", type=int, default=8192, help="fixed memory: new tokens each row reserves room for")
    ap.add_argument("--window", type=int, default=256, help="fixed memory: decode steps timed")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per torchrun")
    ap.add_argument("--checkpoint", default=None, help="where the random checkpoint is written (default: a temp dir)")
    ap.add_argument("--run", default=None, help="label of this run, stored in each record")
    ap.add_argument("--out", default=None, help="history file this run is added to (benchmarks/results/tp_gpu.json)")
    ap.add_argument("--resume", action="store_true",
                    help="add these degrees to the newest run labelled --run in --out (same host and sources), "
                         "so that one run's TP = 1 scales the degrees measured by a later command")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--records", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt, args.new, args.budget = 4, 160, 48, 48
        args.fixed_prompt, args.fixed_new, args.window, args.memory_gib = 64, 96, 16, 8.0
    if args.worker:
        worker(args)
        return 0
    here = environment(allocator=os.environ["PYTORCH_CUDA_ALLOC_CONF"])
    rows: list[dict] = []
    if args.resume:
        if not (args.out and args.run):
            ap.error("--resume needs --out and --run: the run to add to")
        log, earlier = ResultLog.resume(args.out, args.run, here)
        rows = list(earlier["records"])
        if earlier.get("settings") != settings(args):
            ap.error(f"run {log.run_id} measured {earlier.get('settings')}, not {settings(args)}")
    else:
        log = ResultLog(args.out, here) if args.out else None
    cuda = torch.cuda.is_available()
    if not cuda and (not args.smoke or "fixed_memory" in args.kinds):
        ap.error("without a GPU only --smoke --kinds same_batch runs (ranks on the CPU over gloo: checks the script)")
    checkpoint = Path(args.checkpoint or tempfile.mkdtemp(prefix="kvcompose_tp_"))
    write_checkpoint(checkpoint, args.smoke, "cuda" if cuda else "cpu")
    gpu = torch.cuda.get_device_name(0) if cuda else None
    for tp in [int(t) for t in args.tp.split(",") if t]:
        with tempfile.TemporaryDirectory() as scratch:
            rows += [dict(r, gpu=gpu, batch=r.get("batch", args.batch)) for r in
                     run_degree(tp, args, checkpoint, Path(scratch) / "records.json")]
        add_scaling(rows)
        if log is not None:
            log.save({"benchmark": "tp_gpu", "run": args.run or "tp", "smoke": args.smoke,
                      "model": "tiny random Llama" if args.smoke else MODEL, "settings": settings(args),
                      "records": rows})
    print(format_table(TABLE, [[_cell(r.get(c)) for c in TABLE] for r in rows]), flush=True)
    return 0


def _cell(value):
    return f"{value:.3g}" if isinstance(value, float) else value


if __name__ == "__main__":
    raise SystemExit(main())
