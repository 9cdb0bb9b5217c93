"""The ``kvcompose`` command line: list presets and components, generate with a preset, compare presets,
calibrate the sparsity classifier, time decoding against transformers' static cache."""

from __future__ import annotations

import argparse
import json
import sys

from . import threads

DEMO_PROMPT = (
    "A farmer has 17 sheep. He buys 3 times as many goats as sheep, then sells 12 goats. "
    "How many animals does he have now? Think step by step."
)


def _cmd_presets(args) -> int:
    from . import available
    from .policies import presets

    print("presets:")
    for name, desc in presets().items():
        print(f"  {name:<16} {desc}")
    for kind, comps in available().items():
        if comps:
            print(f"{kind}s:")
            for name, desc in comps.items():
                print(f"  {name:<16} {desc}")
    return 0


def _cmd_generate(args) -> int:
    from . import Policy, models

    overrides = {}
    if args.budget is not None:
        overrides["budget"] = args.budget
    policy = Policy.from_preset(args.preset, **overrides)
    if args.min_new_tokens is not None and args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens must lie in [1, --max-new-tokens={args.max_new_tokens}], "
                         f"got {args.min_new_tokens}")
    _loading(args)
    model, tokenizer = models.load(args.model)
    out = policy.generate(
        model, tokenizer, [args.prompt], max_new_tokens=args.max_new_tokens,
        do_sample=args.sample, progress=not args.quiet, memory_basis=args.memory_basis,
        threads=args.cpu_threads.threads,
        **({"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else {}),
        **({"temperature": args.temperature} if args.sample else {}),
    )
    print(out.texts[0])
    print()
    print(f"policy: {json.dumps(policy.to_config())}")
    print(out.report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": policy.to_config(), "text": out.texts[0], "report": out.report.to_dict()}, f, indent=2)
    return 0


def _loading(args, note: str | None = None) -> None:
    """The loading line on stderr, with the CPU thread count this run uses and why."""
    c = getattr(args, "cpu_threads", None)
    how = note or f"on {c.threads} CPU thread{'s' if c.threads != 1 else ''}: {c.reason}; change with --threads or " \
                  f"{threads.ENV}"
    print(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ({how}) ...", file=sys.stderr)


def _preset_list(text: str) -> list[str]:
    presets = [p.strip() for p in text.split(",") if p.strip()]
    if not presets:
        raise ValueError(f"--presets names no preset (got {text!r}); list them with: kvcompose presets")
    return presets


def _number(kind, accepts, what: str):
    """An argparse type: ``kind(text)`` that ``accepts``, else an error saying ``what`` was expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")
_percent = _number(float, lambda v: 0 < v <= 100, "a percentage in (0, 100]")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _cmd_compare(args) -> int:
    import time

    from . import models
    from .eval import build_policies, compare_presets, load_prompts, parse_overrides
    from .eval.result import calibration_line

    presets = _preset_list(args.presets)
    overrides = parse_overrides(args.set)
    budgets = [args.budget] if args.budget is not None else args.budgets
    # Unknown presets, bad overrides and budgets too small for a preset fail before the model loads.
    build_policies(presets, budgets, overrides)
    if args.min_new_tokens is not None and not 0 <= args.min_new_tokens <= args.max_new_tokens:
        raise ValueError(f"--min-new-tokens must lie in [0, --max-new-tokens={args.max_new_tokens}], "
                         f"got {args.min_new_tokens}")
    prompts = load_prompts(args.prompts, args.num_prompts)
    start = time.perf_counter()
    _loading(args, f"the comparison runs at {args.threads} CPU thread{'s' if args.threads != 1 else ''}, "
                   "so its numbers do not depend on the machine's cores or load")
    model, tokenizer = models.load(args.model)
    result = compare_presets(
        model, tokenizer, prompts, presets, budgets=budgets, match_memory_pct=args.match_memory,
        overrides=overrides, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
        batch_size=args.batch_size, progress=not args.quiet, model_name=args.model or "SmolLM2-135M-Instruct (embedded)",
        threads=args.threads,
    )
    paths = result.save(args.out)
    print(result.self_check["message"])
    print()
    print(result.markdown())
    print()
    for c in result.metadata["selection"].get("calibration", []):
        print(f"calibrated: {calibration_line(c)}")
    print(f"{len(prompts)} prompts, {result.self_check['steps']} steps each policy, "
          f"{time.perf_counter() - start:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    return 0 if result.self_check["ok"] else 1


def _cmd_calibrate(args) -> int:
    import time
    import warnings

    from . import models
    from .calibration import (
        EMBEDDED_MODEL_NAME,
        CalibrationWarning,
        calibration_prompts,
        describe,
        run_calibration,
        save_calibration,
    )
    from .classifiers.base import SPARSITY_BIN_TYPES
    from .eval import load_prompts

    if args.num_types not in SPARSITY_BIN_TYPES:  # fail before the model loads
        raise ValueError(f"--num-types must be one of {sorted(SPARSITY_BIN_TYPES)}, got {args.num_types}")
    if args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.prompts:
        prompts = load_prompts(args.prompts, args.num_prompts)
    else:
        prompts = calibration_prompts(args.num_prompts)
    start = time.perf_counter()
    _loading(args)
    model, tokenizer = models.load(args.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # describe() prints the fallback on stdout
        result = run_calibration(
            model, tokenizer, prompts, num_types=args.num_types, num_layers=args.num_layers,
            max_new_tokens=args.max_new_tokens, model_name=args.model or EMBEDDED_MODEL_NAME,
            min_steps=args.min_steps, progress=not args.quiet,
            collect_options={"batch_size": args.batch_size, "min_new_tokens": args.min_new_tokens},
        )
    path = save_calibration(result, args.out)
    print(describe(result))
    print(f"{time.perf_counter() - start:.0f} s; wrote {path}")
    return 0


BENCH_FIELDS = ["timed_steps", "ms_per_step", "steady_ms_per_step", "floor_ms_per_step", "floor_ratio", "tok_per_s",
                "ratio_to_fullkv", "ratio_to_baseline", "peak_gib", "eviction_call_rate", "eviction_share"]


def _bench_cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else ""
    return "" if value is None else f"{value:.4g}"


def _cmd_bench(args) -> int:
    import torch

    from . import models, speed
    from .environment import environment
    from .eval.overrides import at_budgets

    env = environment()  # where and with what this run starts (a later commit must not stamp it)
    presets = _preset_list(args.presets)
    budgets = None if args.budget is None else [args.budget]
    policies = [at_budgets(n, budgets)[0] for n in presets]  # the budget where a preset keeps one, as compare does
    for name, policy in zip(presets, policies):
        if policy.needs_text:
            raise ValueError(f"preset {name!r} reads the generated text and decodes eagerly; kvcompose bench times "
                             f"the static-shape path (see kvcompose generate --preset {name})")
    cuda = torch.cuda.is_available()
    capped = args.memory_gib is not None
    if capped and not cuda:
        raise ValueError(f"--memory-gib {args.memory_gib:g} measures GPU memory and needs a CUDA device; without one, "
                         "time a fixed --batch")
    if not cuda:
        print("kvcompose: no CUDA device: decoding runs without CUDA graphs and the baseline is not compiled; "
              "these numbers say nothing about GPU serving", file=sys.stderr)
    _loading(args)
    model, _ = models.load(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                           device="cuda" if cuda else None)
    model.generation_config.eos_token_id = None
    copy_tbps = speed.copy_tbps(model.device)  # what every run's floor divides by, measured once, here
    kernels = speed.attention_kernels(model.device)
    print(f"kvcompose: decode attention: {kernels}", file=sys.stderr)
    if cuda:
        torch.cuda.empty_cache()  # hand the copy's memory back before any run is measured
    window = None
    if capped:  # each side at the largest batch under the cap, timed over --window steps
        window = min(args.window, args.new_tokens)
        base = speed.fit_transformers_static(model, args.prompt, args.new_tokens, args.memory_gib, window)

        def run(policy):
            return speed.fit_policy(model, policy, args.prompt, args.new_tokens, args.memory_gib, window)
    else:
        ids, mask = speed.random_prompts(model.config.get_text_config().vocab_size, args.batch, args.prompt,
                                         model.device)
        base = speed.time_transformers_static(model, ids, mask, args.new_tokens)

        def run(policy):
            return speed.time_policy(model, policy, ids, mask, args.new_tokens)
    rows = [dict(speed.add_floor(base, copy_tbps), preset="transformers-static", ratio_to_baseline=1.0)]
    for name, policy in zip(presets, policies):
        try:
            row = run(policy)
        except torch.OutOfMemoryError as exc:  # even after backing off: report it, keep the other presets
            print(f"kvcompose: {name}: out of GPU memory ({str(exc).splitlines()[0]})", file=sys.stderr)
            rows.append({"preset": name, "error": "out of memory"})
            continue
        rows.append(dict(speed.add_floor(row, copy_tbps), preset=name,
                         ratio_to_baseline=row["tok_per_s"] / base["tok_per_s"]))
    speed.add_fullkv_ratios(rows, key="preset")
    fields = (["batch", "over_cap"] if capped else []) + BENCH_FIELDS
    width = max(len(r["preset"]) for r in rows)
    print(f"{'preset':<{width}}  " + "  ".join(f"{f:>18}" for f in fields))
    for r in rows:
        cells = [_bench_cell(r.get(f)) for f in fields]
        if "error" in r:
            cells[0] = r["error"]
        print(f"{r['preset']:<{width}}  " + "  ".join(f"{c:>18}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": None if capped else args.batch, "memory_gib": args.memory_gib, "prompt": args.prompt,
                       "new_tokens": args.new_tokens, "window": window, "copy_tbps": copy_tbps,
                       "floor_method": speed.FLOOR_METHOD, "attention_kernels": kernels,
                       "environment": env, "runs": rows}, f, indent=2)
    return 0


def _model_option(parser: argparse.ArgumentParser, threads_default: int | None = None) -> None:
    parser.add_argument("--model", default=None, help="HF model directory/id or .gguf file (default: embedded SmolLM2)")
    parser.add_argument(
        "--threads", type=_positive_int, default=threads_default,
        help=f"CPU threads (default {threads_default}: the same numbers on every machine)" if threads_default else
        f"CPU threads (default: ${threads.ENV}, else $OMP_NUM_THREADS, else the usable cores less the busy ones)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompose", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list presets and registered components")
    p.set_defaults(func=_cmd_presets)

    g = sub.add_parser("generate", help="generate text under a preset and print the memory report")
    g.add_argument("prompt", nargs="?", default=DEMO_PROMPT, help="the prompt (default: a small word problem)")
    g.add_argument("--preset", default="streamingllm", help="preset name (see `kvcompose presets`)")
    g.add_argument("--budget", type=int, default=None, help="tokens kept per sequence and layer")
    _model_option(g)
    g.add_argument("--max-new-tokens", type=_positive_int, default=256)
    g.add_argument("--min-new-tokens", type=_positive_int, default=None,
                   help="do not stop at EOS before this many new tokens (a longer run, to see eviction schedules "
                        "that wait for many tokens, e.g. rkv's 128-token buffer)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=_positive_float, default=0.7)
    g.add_argument("--memory-basis", default="bfloat16", choices=["bfloat16", "float16", "float32", "model"],
                   help="state memory against a full cache in this dtype (default bfloat16, what a GPU user runs; "
                        "'model': the model's own dtype, float32 on CPU)")
    g.add_argument("--json", default=None, help="also write text, policy and report to this JSON file")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser(
        "compare", help="replay a greedy full-KV trajectory under presets and measure fidelity against KV memory",
        description="Generate greedy full-KV trajectories (plain sdpa attention), replay them token by token under "
                    "each preset, and report top-1 agreement, KL, delta NLL and top-10 attention-key recall against "
                    "the KV memory each policy really holds. Writes OUT/fidelity.json, .md and .png.",
    )
    c.add_argument("--presets", default="fullkv,streamingllm,snapkv,h2o,rkv,rpc", help="comma-separated presets")
    size = c.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, default=None, help="one token budget for every budgeted preset")
    size.add_argument("--budgets", type=_int_list, default=None, help="comma-separated budgets to sweep, e.g. 64,128")
    size.add_argument("--match-memory", type=_percent, default=None, metavar="PCT",
                      help="calibrate each compressing preset's budget (RPC: period) on the first prompt so its "
                           "measured mean KV memory is closest to PCT%% of full")
    c.add_argument("--set", action="append", default=[], metavar="PRESET.FIELD=VALUE",
                   help="override a preset field, e.g. rpc.trigger.period=64 (repeatable; VALUE is JSON or a string)")
    c.add_argument("--prompts", default=None, help="prompt file: .json list or one prompt per line "
                                                   "(default: kvcompose's reasoning prompts)")
    c.add_argument("--num-prompts", type=_positive_int, default=3, help="use the first K prompts (default 3)")
    c.add_argument("--max-new-tokens", type=_positive_int, default=256)
    c.add_argument("--min-new-tokens", type=int, default=None,
                   help="mask EOS until this many tokens (default: --max-new-tokens, so every prompt runs the full "
                        "length; the masking is recorded and replayed)")
    c.add_argument("--batch-size", type=_positive_int, default=4,
                   help="prompts replayed together (1: exact per-prompt memory)")
    _model_option(c, threads_default=1)
    c.add_argument("--out", default="fidelity", help="output directory (default: ./fidelity)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_compare)

    k = sub.add_parser(
        "calibrate", help="fit the sparsity_kde thought classifier's thresholds and layers for a model",
        description="Greedy-decode calibration prompts under fullkv, record every layer's attention sparsity at "
                    "every decode step, and fit ThinKV's KDE thresholds and layer subset L*. Writes a JSON file for "
                    "{'name': 'sparsity_kde', 'calibration': FILE}.",
    )
    _model_option(k)
    k.add_argument("--prompts", default=None, help="prompt file: .json list or one prompt per line (default: "
                                                   "kvcompose's reasoning prompts plus its calibration prompts)")
    k.add_argument("--num-prompts", type=_positive_int, default=None, help="use the first N prompts (default: all)")
    k.add_argument("--max-new-tokens", type=_positive_int, default=256)
    k.add_argument("--min-new-tokens", type=int, default=0,
                   help="mask EOS until this many tokens (default 0: each prompt stops at its EOS)")
    k.add_argument("--num-types", type=int, default=3, help="thought types to separate (1-3; default 3)")
    k.add_argument("--num-layers", type=int, default=4, help="size of the layer subset L* (default 4)")
    k.add_argument("--min-steps", type=int, default=16,
                   help="leave out prompts with fewer decode steps than this (default 16)")
    k.add_argument("--batch-size", type=_positive_int, default=4, help="prompts decoded together (default 4)")
    k.add_argument("--out", required=True, help="calibration JSON to write")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=_cmd_calibrate)

    b = sub.add_parser(
        "bench", help="decode throughput of presets against transformers' compiled static cache, on your model",
        description="Greedy decoding of the same random prompts (EOS disabled): transformers' static cache with its "
                    "compiled step first, then each preset through kvcompose's static-shape path (CUDA graphs); both "
                    "time the same decode steps. Prints ms/step, its floor (weight and KV bytes read per step over "
                    "the copy bandwidth measured on the device), tok/s, the ratios to fullkv and to the baseline, "
                    "peak GPU memory and the eviction steps' share.",
    )
    _model_option(b)
    b.add_argument("--presets", default="fullkv,nvfp4,rkv,thinkv", help="comma-separated presets")
    b.add_argument("--budget", type=int, default=None, help="token budget for the budgeted presets")
    b.add_argument("--batch", type=_positive_int, default=16)
    b.add_argument("--prompt", type=_positive_int, default=512, help="prompt tokens per row")
    b.add_argument("--new-tokens", type=_positive_int, default=1024)
    b.add_argument("--memory-gib", type=_positive_float, default=None,
                   help="fixed memory (CUDA): run each side at the largest batch whose peak GPU memory, weights "
                        "included, stays under this many GiB for prompt + new tokens (ignores --batch)")
    b.add_argument("--window", type=_positive_int, default=512,
                   help="with --memory-gib: decode steps timed (the capacity is still reserved for --new-tokens)")
    b.add_argument("--json", default=None, help="also write every run's fields to this JSON file")
    b.set_defaults(func=_cmd_bench)
    return parser


#: What a user's input can raise: bad names, values and configs (``ValueError``, the registry's
#: ``KeyError``), missing optional packages, and files or models that cannot be read (``OSError``,
#: which is also what transformers raises for a model it cannot find). Anything else is a bug and
#: keeps its traceback.
USER_ERRORS = (ValueError, KeyError, ModuleNotFoundError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not hasattr(args, "threads") or args.func is _cmd_compare:  # compare pins its own count
            return args.func(args)
        args.cpu_threads = threads.choose(args.threads)
        with threads.fixed(args.cpu_threads.threads):
            return args.func(args)
    except USER_ERRORS as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"kvcompose: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
