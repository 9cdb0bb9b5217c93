"""Render the recorded benchmark JSON files as the docs' results page (docs/benchmark-results.md).

Each file is a history of runs (:mod:`harness.results`); a section shows the newest run that
is not a ``--smoke`` check, and the end-to-end table the newest record of each policy and
scenario with its run's baseline. Run after adding or re-running a benchmark so the docs
never drift from the JSON:

    python benchmarks/summarize.py            # write the page and its plot
    python benchmarks/summarize.py --check    # exit 1 if they differ from the JSON (the tests run this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.results import latest_run, read_runs  # noqa: E402
from harness.table import NONE, markdown_table as _table, run_gpu as _run_gpu  # noqa: E402
from harness.cpu_section import cpu_decode  # noqa: E402
from harness.tp_section import tensor_parallel  # noqa: E402

RESULTS = ROOT / "results"
#: ``kvcompose.policies.policy.DEFAULT_POOL_LAYOUT`` (a test keeps the two equal; the page needs no torch).
DEFAULT_POOL_LAYOUT = "head"
#: ``launch.TOKENS_PER_SPLIT_MIN``, ``launch.SMALL_SOURCE_TOKENS`` and the attention benchmark's ``BUFFER``: the
#: launch settings of its grids (a test keeps them equal)
TOKENS_PER_SPLIT_MIN, SMALL_SOURCE_TOKENS, DEFAULT_BUFFER = 256, 64, 16
OUT = ROOT.parent / "docs" / "benchmark-results.md"
SVG = ROOT.parent / "docs" / "results" / "e2e_throughput.svg"
BASELINE = "transformers-static"


def _load(name: str) -> dict | None:
    return latest_run(RESULTS / name)


def _env(data: dict) -> str:
    env = data.get("environment") or data.get("meta") or {}
    versions = env.get("versions") or {k: env.get(k) for k in ("torch", "triton")}
    vers = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return f"{env.get('gpu') or env.get('cpu') or 'CPU'} · {vers} · {env.get('date', '')}"


def quant(lines: list[str]) -> None:
    data = _load("quant_gpu.json")
    if not data:
        return
    copy = data["copy"]["tbps"]
    summary = data["summary"]
    lines += ["## Quantize / dequantize throughput", "", f"`quant_gpu.json` — {_env(data)}", "",
              f"Device-to-device copy: **{copy:.2f} TB/s**. Effective TB/s counts bytes read + written (the "
              f"default path reads its input twice); target: {100 * data['target_frac_copy']:.0f}% of copy, "
              f"judged on the kernel time (CUDA-graph replay). **{summary['meet_target']} of "
              f"{summary['configurations']}** configurations meet it. *call* is the eager Python call "
              "(host checks, launches and, for quantize, the host synchronization that reads the error flag).", ""]
    rows = [[r["format"], r["tokens"], r["op"], r["path"], f"{r['ms']:.3f}", f"{r['tbps']:.2f}",
             f"{100 * r['frac_copy']:.1f}", "yes" if r["meets_target"] else "no",
             f"{r['call_ms']:.3f}" if "call_ms" in r else "", "yes" if r["matches_reference"] else "no"]
            for r in data["results"] if r.get("status") == "ok"]
    lines += _table(["format", "tokens", "op", "path", "kernel ms", "TB/s", "% of copy", "≥ target", "call ms",
                     "bit-exact"], rows) + [""]


#: What a run's ``attention_kernels`` says when the packed pools were read by the Triton kernel (the
#: CUDA kernel switched off with ``KVCOMPOSE_NATIVE_ATTENTION=0``, or not built).
NATIVE_OFF = "pools: Triton ("


def layout_labelled(runs: list[dict]) -> list[dict]:
    """``runs`` with each kvcompose record named by what ran: the preset, ``@layout`` where its
    pools' rows were not in today's default order (``nvfp4@slot``), and ``/triton`` where the
    run's packed pools were read by the Triton kernel (its ``attention_kernels`` says so: the CUDA
    kernel switched off or not built). A record without ``pool_layout`` ran on the layout its name
    asks for (``nvfp4@head``), else on slot-major pools, the default when it was made. The file
    keeps the names as recorded."""
    def label(r: dict, triton_only: bool) -> dict:
        if r["policy"] == BASELINE:
            return r
        name, _, asked = r["policy"].partition("@")
        layout = r.get("pool_layout") or asked or "slot"
        name = name if layout == DEFAULT_POOL_LAYOUT else f"{name}@{layout}"
        return dict(r, policy=f"{name}/triton" if triton_only else name)

    return [dict(entry, records=[label(r, NATIVE_OFF in (entry.get("attention_kernels") or ""))
                                 for r in entry["records"]]) for entry in runs]


def shown_e2e_records(runs: list[dict]) -> list[tuple[dict, dict | None]]:
    """The end-to-end records the page shows, in file order, each with its run's environment:
    the newest record of every (policy, scenario) and the baseline it was measured against
    (the transformers-static record of the same run and scenario)."""
    flat = []
    for i, entry in enumerate(runs):
        env = entry.get("environment") or {}
        by_label = env.get("runs")  # the older layout: one entry, every run's environment by its label
        for r in entry["records"]:
            flat.append((i, r, by_label.get(r.get("run")) if isinstance(by_label, dict) else env))
    newest = {(r["policy"], r["scenario"]): n for n, (_, r, _) in enumerate(flat) if r["policy"] != BASELINE}
    used = {(flat[n][0], flat[n][1].get("run"), flat[n][1]["scenario"]) for n in newest.values()}
    keep = set(newest.values()) | {n for n, (i, r, _) in enumerate(flat)
                                   if r["policy"] == BASELINE and (i, r.get("run"), r["scenario"]) in used}
    return [(r, env) for n, (_, r, env) in enumerate(flat) if n in keep]


#: The scenarios of ``bench_e2e_gpu.SCENARIOS`` (a test keeps the two equal), in the page's order.
E2E_SCENARIOS = {
    "a": dict(batch=16, prompt=512, new=2048, budget=1024),
    "b": dict(batch=16, prompt=512, new=8192, budget=1024),
    "long": dict(batch=16, prompt=8192, new=512, budget=1024),
    "c": dict(batch=None, prompt=512, new=8192, budget=1024),
}
GROWING = "fullkv, fp8, nvfp4, kivi2, thinkv-tbq and rpc"  # presets whose cache grows with every token


def _scenario_method(name: str, shape: dict, records: list[dict]) -> str:
    """A few sentences on what scenario ``name`` runs and times."""
    prompt, new, budget = f"{shape['prompt']:,}", f"{shape['new']:,}", f"{shape['budget']:,}"
    reserved = f"{shape['prompt'] + shape['new']:,}"
    if name == "c":
        caps = sorted({r["memory_cap_gib"] for r in records if r.get("memory_cap_gib") is not None})
        cap = " or ".join(f"{c:g} GiB" for c in caps) or "the cap"
        return (f"**Fixed memory.** Prompts of {prompt} tokens and {new} new tokens: each side runs at the largest "
                f"batch whose peak GPU memory, weights included, stays under {cap}, kvcompose's stores holding room "
                f"for all {new} new tokens and the baseline's static cache reserved for {reserved} tokens. Both sides "
                "time the same first decode steps of the run (*steps timed*), each at its own batch (*x baseline* and "
                "*x fullkv* compare tok/s across batches). The presets whose cache keeps growing "
                f"({GROWING}) hold fewer tokens in that window than later in the run, so for them a window's "
                "throughput overstates the whole run's; the budgeted ones reach their budget of "
                f"{budget} tokens within the first {shape['budget'] - shape['prompt']:,} steps.")
    title = {"a": "Same batch", "b": "Long reasoning", "long": "Long prompt"}[name]
    text = (f"**{title}.** Batch {shape['batch']}, prompts of {prompt} tokens, {new} new tokens; the budgeted "
            f"presets keep {budget} tokens per row. Both sides time every decode step (*steps timed*: each new "
            f"token after the first, which the prefill produces); the baseline's static cache is reserved for "
            f"{reserved} tokens, which its attention spans at every step.")
    if name == "long":
        text += (f" The prompt is {shape['prompt'] // shape['budget']} times the budget: what a budgeted preset "
                 "keeps of it decides the bytes each step reads.")
    return text


def _cold_runs(records: list[dict]) -> list[str]:
    """Runs whose presets were timed after a warm-up at another capacity (records with
    ``one_time_s`` but no ``warm_up_s``): kernels specialized on the capacity compiled in the
    timed steps of the first preset that used them."""
    return _runs_without([r for r in records if "one_time_s" in r], "warm_up_s")


def _runs_without(records: list[dict], field: str) -> list[str]:
    """The runs, in order, none of whose preset records (baseline left out) holds ``field``."""
    timed = [r for r in records if r["policy"] != BASELINE]
    runs = dict.fromkeys(r.get("run") for r in timed)
    return [run for run in runs if not any(field in r for r in timed if r.get("run") == run)]


def _synced_runs(records: list[dict]) -> list[str]:
    """Runs whose presets were timed on the profiled run (records with ``steady_ms_per_step``
    but no ``profiled_ms_per_step``): it waits for the device before every step."""
    return _runs_without([r for r in records if r.get("steady_ms_per_step") is not None], "profiled_ms_per_step")


def _uneven_runs(records: list[dict]) -> list[str]:
    """Runs whose baseline timed other steps than their presets (recorded before both sides
    timed the same steps)."""
    out = []
    for run in dict.fromkeys(r.get("run") for r in records):
        same = [r for r in records if r.get("run") == run and "error" not in r]
        base = [r["new_tokens"] for r in same if r["policy"] == BASELINE]
        if base and any(r["new_tokens"] != base[0] for r in same if r["policy"] != BASELINE):
            out.append(run)
    return out


def _e2e_row(r: dict, env) -> list:
    """One record as a table row; a field the record lacks shows as NONE."""
    def num(key: str, fmt: str, scale: float | None = None) -> str:
        value = r.get(key)
        if value is None:
            return NONE
        return fmt.format(value if scale is None else scale * value)

    head = [r["policy"], r.get("run", r["scenario"]), _run_gpu(env), num("batch", "{:,}"), num("new_tokens", "{:,}"),
            num("timed_steps", "{:,}")]
    if "error" in r:
        return head + [f"error: {r['error'].split('.')[0]}"] + [NONE] * 8
    return head + [num("ms_per_step", "{:.1f}"), num("steady_ms_per_step", "{:.1f}"), num("floor_ms_per_step", "{:.2f}"),
                   num("floor_ratio", "{:.2f}"), num("tok_per_s", "{:,.0f}"), num("ratio_to_fullkv", "{:.2f}"),
                   num("ratio_to_baseline", "{:.2f}"), num("peak_gib", "{:.1f}"),
                   num("eviction_share", "{:.1f}", 100.0) if r["policy"] != BASELINE else NONE]


E2E_COLUMNS = ["policy", "run", "GPU", "batch", "new tokens", "steps timed", "ms/step", "steady ms/step",
               "floor ms/step", "floor ratio", "tok/s", "x fullkv", "x baseline", "peak GiB", "eviction share %"]


def e2e(lines: list[str], figures: dict, runs: list[dict] | None = None) -> None:
    """The end-to-end section from ``runs`` (default: ``e2e_gpu.json``'s); a run's ``notes`` stay
    in the JSON."""
    if runs is None:
        runs = read_runs(RESULTS / "e2e_gpu.json")
    runs = layout_labelled([r for r in runs if not r.get("smoke")])
    if not runs:
        return
    shown = shown_e2e_records(runs)
    lines += ["## End-to-end decode against transformers' static cache", "",
              f"`e2e_gpu.json` — latest run: {_env(runs[-1])}. Each table shows the newest record of every policy in "
              "that scenario and the baseline of the same run; every earlier run stays in the JSON.", "",
              "**What runs.** `benchmarks/bench_e2e_gpu.py` loads a Llama-3-8B-shaped model with random weights in "
              "bf16 (32 layers, 32 query heads, 8 KV heads of 128, vocabulary 128,256) and decodes the same random "
              "prompts greedily with EOS disabled, in one process per run: first the baseline, transformers' static "
              "cache with its compiled decode step (sdpa attention), then each kvcompose preset through the "
              "static-shape path replayed as CUDA graphs (`fast_generate`). Decoding speed does not depend on the "
              "weights. A policy is the preset as named; `preset@slot` ran with its pools' rows slot-major "
              "(`Policy.pool_layout=\"slot\"`, the default before head-major rows became it), `preset+hadamard` "
              "with the Hadamard rotation of the stored keys and values, `preset/triton` without the CUDA attention "
              "kernel (switched off with `KVCOMPOSE_NATIVE_ATTENTION=0`, or not built: every pool read by the "
              "Triton kernel).", "",
              "**What is timed.** *ms/step* is decode wall time over the steps timed: for kvcompose from its first "
              "decode step to the end with a fresh cache, decoding as a user's call does (the host queues steps "
              "ahead of the GPU), so the one-time work of its CUDA graphs (each variant's first run, capture and "
              "first replay) is included; for the baseline its run's wall time less a prefill-only run's, compiled "
              "and recorded beforehand. A second, profiled run of the same decode times each step with CUDA events: "
              "*steady ms/step* is its GPU time per step without the one-time work, what a long run approaches. "
              "*x baseline* and *x fullkv* divide tok/s by the baseline's and by kvcompose fullkv's in the same run "
              "and scenario. Runs differ in GPU and in "
              "the code that ran: compare ratios within a run, not milliseconds across runs. *eviction share*: the "
              "share of decode time that eviction, refresh and eager steps take beyond a plain step's cost.", "",
              "**The floor.** *floor ms/step* is the time a step needs to read its bytes once at the copy bandwidth "
              "measured in the same process (a 2 GiB device-to-device copy, read plus written bytes over its median "
              "time). The bytes: every weight (all parameters but the input embedding table, of which a step reads "
              "one row per sequence; all of it when tied to the LM head) plus the KV cache a step reads: for "
              "kvcompose the mean of the cache's live bytes (payload, scales, metadata, recent buffer) right after "
              "the prefill and at the end of the run; for the baseline its whole reserved static cache, which its "
              "attention spans at every step, so its floor is the same at every step. *floor ratio* = ms/step over "
              "the floor: 1 would be a step that does nothing but read its bytes once. Records made before the "
              f"floor, the steps timed and the ratio to fullkv were recorded show {NONE} there.", ""]
    for name, shape in E2E_SCENARIOS.items():
        records = [(r, env) for r, env in shown if r["scenario"] == name]
        lines += [f"### Scenario {name}", "", _scenario_method(name, shape, [r for r, _ in records]), ""]
        uneven = _uneven_runs([r for r, _ in records])
        if uneven:
            lines += [f"In run{'s' if len(uneven) > 1 else ''} {', '.join(uneven)}, recorded before both sides timed "
                      "the same steps, the baseline was timed over fewer new tokens than the presets (the *new "
                      "tokens* column); its step costs the same at every step, as it spans its whole reserved cache.",
                      ""]
        cold = _cold_runs([r for r, _ in records])
        if cold:
            spent = [r["one_time_s"] for r, _ in records if r.get("run") in cold and "one_time_s" in r]
            low, high = f"{min(spent):.1f}", f"{max(spent):.1f}"
            lines += [f"In run{'s' if len(cold) > 1 else ''} {', '.join(cold)}, recorded before the warm-up ran at "
                      "the timed run's capacity, kernels specialized on that capacity compiled in the timed steps of "
                      "the first preset that used them, and presets later in the run reused them: *ms/step* carries "
                      f"that work ({low if low == high else f'{low}-{high}'} s of one-time work per preset in these "
                      "records, graph captures included); *steady ms/step* leaves it out.", ""]
        synced = _synced_runs([r for r, _ in records])
        if synced:
            lines += [f"In run{'s' if len(synced) > 1 else ''} {', '.join(synced)}, kvcompose's *ms/step* comes from "
                      "the profiled run, which waits for the device before every step: it carries the host's own "
                      "time per step and every graph capture's host time, which an unprofiled decode hides behind "
                      "the steps it has queued.", ""]
        if not records:
            lines += ["No run recorded yet.", ""]
            continue
        order = {run: i for i, run in enumerate(dict.fromkeys(r.get("run") for r, _ in records))}
        records.sort(key=lambda item: (-order[item[0].get("run")], item[0]["policy"] != BASELINE))
        lines += _table(E2E_COLUMNS, [_e2e_row(r, env) for r, env in records]) + [""]
    figures[SVG] = _throughput_svg([r for r, _ in shown if "tok_per_s" in r])
    lines += ["![Throughput against batch](results/e2e_throughput.svg)", ""]


def _throughput_svg(records: list[dict]) -> str:
    """tok/s against batch (log-log), one labelled point per run; no plotting library needed."""
    import math

    W, H, pad = 640, 400, 60
    xs = [math.log2(r["batch"]) for r in records]
    ys = [math.log10(r["tok_per_s"]) for r in records]
    x0, x1 = min(xs) - 0.5, max(xs) + 0.5
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))

    def px(x, y):
        return pad + (x - x0) / (x1 - x0) * (W - 2 * pad), H - pad - (y - y0) / (y1 - y0) * (H - 2 * pad)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           'font-size="10">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 20}" text-anchor="middle">batch (log scale)</text>',
           f'<text x="15" y="{H / 2}" transform="rotate(-90 15 {H / 2})" text-anchor="middle">tokens/s (log scale)</text>']
    for y in range(y0, y1 + 1):
        _, py = px(x0, y)
        out.append(f'<text x="{pad - 5}" y="{py + 3}" text-anchor="end">{10 ** y:g}</text>')
    for b in sorted({r["batch"] for r in records}):
        bx, _ = px(math.log2(b), y0)
        out.append(f'<text x="{bx}" y="{H - pad + 14}" text-anchor="middle">{b}</text>')
    for r, x, y in zip(records, xs, ys):
        cx, cy = px(x, y)
        color = "#c0392b" if r["policy"] == BASELINE else "#2471a3"
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}"/>')
        out.append(f'<text x="{cx + 5:.1f}" y="{cy - 3:.1f}" fill="{color}">{r["policy"]} ({r["scenario"]})</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def launch_settings(run: dict) -> tuple:
    """An attention run's recent buffer and launch settings (``--riders-in-merge``, ``--buffer``, ``--split-min``,
    ``--small-source``), as runs made before an option existed ran it."""
    return (run.get("riders_in_merge", "native"), run.get("shapes", {}).get("buffer_tokens", DEFAULT_BUFFER),
            run.get("tokens_per_split_min", TOKENS_PER_SPLIT_MIN), run.get("small_source_tokens", SMALL_SOURCE_TOKENS))


def full_attention_grid(runs: list[dict], layout: str = DEFAULT_POOL_LAYOUT) -> dict | None:
    """The newest run of the whole grid at the default launch settings on pools of ``layout``
    (runs before ``--layout`` existed are slot-major). Runs of a few formats (``--formats``: newer
    runs record ``narrowed``; in older ones, a grid has the bf16 row and every format of the grids
    before it) or with the recent buffer or the splits set otherwise (``--riders-in-merge``, ``--buffer``,
    ``--split-min``, ``--small-source``) answer a narrower question and stay in the JSON only."""
    full, seen = [], set()
    default = ("native", DEFAULT_BUFFER, TOKENS_PER_SPLIT_MIN, SMALL_SOURCE_TOKENS)
    for r in runs:
        if r.get("smoke") or launch_settings(r) != default or r.get("layout", "slot") != layout:
            continue
        formats = {x["format"] for x in r.get("results", ())}
        grid = not r["narrowed"] if "narrowed" in r else ("bf16" in formats and formats >= seen)
        if grid:
            full.append(r)
            seen |= formats
    return full[-1] if full else None


def runs_since_grid(runs: list[dict], grid: dict) -> list[dict]:
    """The runs of a few formats (``narrowed``) made after ``grid`` on its pool layout and launch settings:
    what changed since, beside the grid's figure of the same (format, kernel, shape)."""
    after = runs[next(i for i, r in enumerate(runs) if r is grid) + 1:]
    return [r for r in after if r.get("narrowed") and not r.get("smoke") and r.get("layout", "slot") ==
            grid.get("layout", "slot") and launch_settings(r) == launch_settings(grid)]


def attention_since_grid(lines: list[str], runs: list[dict], grid: dict) -> None:
    """One table per run of a few formats made after the grid: each row beside the grid's figure."""
    def key(r: dict) -> tuple:
        return r["format"], r.get("kernel", "triton"), r["batch"], r["tokens"], r.get("head_dim", 128)

    before = {key(r): r for r in grid["results"]}
    for run in runs_since_grid(runs, grid):
        rows = [[r["format"], r.get("kernel", "triton"), f"{r['batch']}x{r['tokens']}x{r.get('head_dim', 128)}",
                 f"{1e3 * r['ms']:.0f}", f"{100 * r['fraction_of_copy']:.0f}",
                 f"{100 * before[key(r)]['fraction_of_copy']:.0f}" if key(r) in before else "—",
                 f"{before[key(r)]['ms'] / r['ms']:.2f}" if key(r) in before else "—"] for r in run["results"]]
        lines += [f"### A run of {', '.join(run['formats'])} since the grid", "",
                  f"{_env(run)}; copy bandwidth {run['copy_tb_per_s']:.2f} TB/s. *grid*: the grid above; *x grid*: "
                  "its time over this run's (two runs: compare with the bf16 rows of both).", ""]
        lines += _table(["format", "kernel", "B x L x D", "µs", "% of copy", "grid % of copy", "x grid"], rows) + [""]


def attention_layouts(lines: list[str], runs: list[dict]) -> None:
    """The newest full grid of each pool layout side by side: what the default layout buys."""
    slot, head = (full_attention_grid(runs, layout) for layout in ("slot", "head"))
    if not (slot and head):
        return
    def key(r: dict) -> tuple:
        return r["format"], r.get("kernel", "triton"), r["batch"], r["tokens"], r.get("head_dim", 128)

    before = {key(r): r for r in slot["results"]}
    rows = [[r["format"], r.get("kernel", "triton"), f"{r['batch']}x{r['tokens']}x{r.get('head_dim', 128)}",
             f"{1e3 * before[key(r)]['ms']:.0f}", f"{1e3 * r['ms']:.0f}",
             f"{100 * before[key(r)]['fraction_of_copy']:.0f}", f"{100 * r['fraction_of_copy']:.0f}",
             f"{before[key(r)]['ms'] / r['ms']:.2f}"] for r in head["results"] if key(r) in before]
    lines += ["### Pool layout: slot-major against head-major", "",
              f"The newest full grid on slot-major pools ({_env(slot)}; copy bandwidth "
              f"{slot['copy_tb_per_s']:.2f} TB/s) beside the newest on head-major pools ({_env(head)}; "
              f"{head['copy_tb_per_s']:.2f} TB/s): two runs, so compare each row with how far the bf16 rows "
              "moved between them (their pools change layout too). *x* is the slot-major time over the "
              "head-major one.", ""]
    lines += _table(["format", "kernel", "B x L x D", "slot µs", "head µs", "slot % of copy", "head % of copy", "x"],
                    rows) + [""]


def mixed_store(mixed, preset: str = "thinkv") -> str:
    """What the *mixed* (*mixed-int*) rows of an attention run hold, from the run's ``shapes.mixed``
    (``shapes.mixed_int``): a list of formats (runs before the store followed the ``thinkv``
    preset: a pool of each, ThinKV's R8E4T2 mapping) or the preset's class -> format map."""
    def shown(spec: dict) -> str:
        name = {"nvfp4": "NVFP4", "fp8": "FP8"}.get(spec["name"], spec["name"])
        return f"INT{spec['bits']} (groups of {spec['group_size']})" if name == "int" else name

    if isinstance(mixed, dict):
        classes = ", ".join(f"{c} {shown(spec)}" for c, spec in mixed.items())
        return (f"ThinKV's store as the `{preset}` preset keeps it ({classes}; each class a third of the tokens, "
                "classes of one format as regions of one pool)")
    names = [("an " if shown({"name": f})[0] in "NF" else "a ") + shown({"name": f}) for f in mixed]
    return f"ThinKV's R8E4T2 mapping ({', '.join(names[:-1])} and {names[-1]} pool of a third of the tokens each)"


def attention(lines: list[str]) -> None:
    runs = read_runs(RESULTS / "attention_gpu.json")
    data = full_attention_grid(runs)
    if not data:
        return
    t = data["targets"]
    lines += ["## Fused paged decode attention", "", f"`attention_gpu.json` — {_env(data)}", "",
              "One decode step of one layer at Llama-3-8B shapes (32 query heads, 8 KV heads of 128, and head dim "
              "64 where D says so): the tokens sit in shuffled 16-slot blocks "
              f"({' and '.join(data['shapes'].get('block_sizes', {'kivi2': 32}))}: 32-slot blocks and token "
              f"groups, as their presets) in their storage format, rows {data.get('layout', 'slot')}-major "
              "(`Policy.pool_layout`), plus a 16-token bf16 buffer; *mixed* is "
              f"{mixed_store(data['shapes'].get('mixed', ['ternary', 'nvfp4', 'fp8']))}"
              + (f"; *mixed-int* is {mixed_store(data['shapes']['mixed_int'], 'thinkv-int')}"
                 if "mixed_int" in data["shapes"] else "") + ". The op is timed "
              "as a CUDA-graph replay (its partial launches and the merge), once per kernel: *triton*, and *cuda* "
              "(the CUDA kernel, on the pools it takes) where it ran. TB/s counts the bytes the op "
              f"must read (codes, scales, block tables, validity, queries); copy bandwidth "
              f"**{data['copy_tb_per_s']:.2f} TB/s**. SDPA: bf16 K/V of the same logical tokens, flash backend, "
              f"no mask. Targets: {t['frac_copy']:.0%} of copy at the three larger shapes; speed-up "
              + ", ".join(f"{k} {v}x" for k, v in t["speedup"].items()) + ". *launch*: tokens per tile x warps "
              "of the partial kernel. "
              + data.get("notes", ""), ""]

    def launch(r):
        return f"{r['launch']['tile_tokens']} x {r['launch']['warps']}" if "launch" in r else ""

    def vs_bf16(r):
        return f"{r['speedup_vs_bf16_kernel']:.2f}" if r.get("speedup_vs_bf16_kernel") else ""

    rows = [[r["format"], r.get("kernel", "triton"), f"{r['batch']}x{r['tokens']}x{r.get('head_dim', 128)}", launch(r),
             f"{1e3 * r['ms']:.0f}", f"{r['tb_per_s']:.2f}", f"{100 * r['fraction_of_copy']:.0f}",
             f"{1e3 * r['sdpa_ms']:.0f}", f"{r['speedup_vs_sdpa']:.2f}", vs_bf16(r),
             f"{r['max_abs_diff_vs_reference']:.1e}"] for r in data["results"]]
    lines += _table(["format", "kernel", "B x L x D", "launch", "µs", "TB/s", "% of copy", "SDPA µs", "x SDPA",
                     "x bf16 kernel", "max diff vs ref"], rows) + [""]
    attention_since_grid(lines, runs, data)
    attention_layouts(lines, runs)


def eviction(lines: list[str]) -> None:
    data = _load("eviction_gpu.json")
    if not data:
        return
    sdpa = {(a["batch"], a["budget"]): a for a in data["attention"]}
    lines += ["## Eviction step (Llama-3-8B shapes, 32 layers)", "", f"`eviction_gpu.json` — {_env(data)}", "",
              "One eviction step (score + select + gather) timed on one layer ×32; *amortized* divides by the "
              "128-token buffer of R-KV's schedule; SDPA is bf16 attention of one decode step over the same "
              "candidates (all 32 layers).", ""]
    rows = []
    for r in data["results"]:
        a = sdpa.get((r["batch"], r["budget"]), {})
        if r["status"] != "ok":
            rows.append([r["preset"], r["batch"], r["budget"], r["status"], "", "", ""])
            continue
        rows.append([r["preset"], r["batch"], r["budget"], f"{r['eviction_ms_per_step']:.1f}",
                     f"{r['amortized_ms_per_decode_step']:.2f}", f"{a.get('sdpa_ms_per_step', float('nan')):.2f}",
                     f"{r['peak_gib']:.1f}"])
    lines += _table(["preset", "batch", "budget", "evict ms/step", "amortized ms/step", "SDPA ms/step",
                     "peak GiB"], rows) + [""]


def thinkv(lines: list[str]) -> None:
    data = _load("thinkv_vs_rkv_gpu.json")
    if not data:
        return
    c = data["config"]
    lines += ["## ThinKV vs R-KV: call rate and time breakdown", "", f"`thinkv_vs_rkv_gpu.json` — {_env(data)}", "",
              f"Llama-3-8B-shaped model with random weights (bf16), batch {c['batch']}, prompt {c['prompt']}, "
              f"{c['new_tokens']} new tokens, budget 1024. Phase times are synchronized wall time inside the "
              "cache (attention = SDPA over the gathered view; eviction = trigger + scoring + pager; refresh = "
              "ThinKV's sparsity classifier); the rest of the total is the model's other layers and the store's "
              "append/gather. ThinKV's classifier uses stand-in thresholds (a random model has no calibration).", ""]
    rows = []
    for name, r in data["results"].items():
        t = r.get("time_s") or {}
        rows.append([name, f"{r['tokens_per_s']:.1f}", f"{r['eviction_call_rate_pct']:.2f}",
                     f"{t.get('attention', 0):.2f}", f"{t.get('eviction', 0):.2f}", f"{t.get('refresh', 0):.2f}",
                     f"{r['total_s']:.1f}", f"{r['memory_pct']:.1f}", f"{r['avg_bits']:.2f}"])
    lines += _table(["policy", "tok/s", "call rate %", "attention s", "eviction s", "refresh s", "total s",
                     "KV mem %", "avg bits"], rows) + [""]


def thinkv_ops(lines: list[str]) -> None:
    data = _load("thinkv_ops_gpu.json")
    if not data:
        return
    lines += ["## ThinKV ops: attention sparsity and batched K-means", "", f"`thinkv_ops_gpu.json` — {_env(data)}",
              ""]
    rows = [[r["batch"], r["length"], f"{r['triton_scores_us']:.0f}", f"{r['torch_reference_us']:.0f}",
             f"{r.get('sdpa_bf16_us', float('nan')):.0f}"] for r in data["sparsity"]]
    lines += _table(["batch", "keys", "Triton µs", "torch µs", "bf16 SDPA µs"], rows) + [""]
    rows = [[r.get("segments"), r.get("k"), f"{r.get('triton_us', float('nan')):.0f}",
             f"{r.get('torch_reference_us', float('nan')):.0f}"] for r in data["kmeans"]]
    lines += _table(["segments", "K", "Triton µs", "torch µs"], rows) + [""]


def redundancy(lines: list[str]) -> None:
    data = _load("redundancy_gpu.json")
    if not data:
        return
    lines += ["## R-KV redundancy scores: dense torch vs the fused kernel", "",
              f"`redundancy_gpu.json` — {_env(data)}", "",
              "Column sums of the key-similarity matrix with the newest similar partner spared (beta = 1) or not "
              "(beta = 0); batch 16, 8 KV heads x 128, bf16, threshold 0.5. Peak MiB is the scratch memory of one call.",
              ""]
    rows = [[r["candidates"], r["beta"], f"{r['dense_ms']:.2f}", f"{r['kernel_ms']:.2f}", f"{r['speedup']:.1f}",
             f"{r['dense_peak_mib']:.0f}", f"{r['kernel_peak_mib']:.0f}", r["agree"]] for r in data["results"]]
    lines += _table(["candidates", "beta", "dense ms", "kernel ms", "speedup", "dense MiB", "kernel MiB", "agree"],
                    rows) + [""]


def sharing(lines: list[str]) -> None:
    data = _load("sharing_gpu.json")
    if not data:
        return
    first = data["results"][0]
    lines += ["## ReasonCache: filter and sharing step", "", f"`sharing_gpu.json` — {_env(data)}", "",
              f"Llama-3-8B cache shapes ({first['layers']} layers, {first['kv_heads']} KV heads x {first['head_dim']}, "
              f"{first['dtype']}), batch {first['batch']}, prompt {first['prompt']}, {first['steps']} decode steps of "
              f"a scripted reasoning text ({100 * first['repeat_share']:.0f}% of steps repeat an earlier one, "
              f"{100 * first['formula_share']:.0f}% of new steps carry a formula); keys and values written straight "
              "into the stores (no model), repeats reuse the repeated step's values plus noise. Times are the host "
              "wall clock of `SharingTracker.after_forward` after each forward (CUDA synchronized): *step-end* calls "
              "decide finished steps (every row of a batch of equal prompts decides in the same call), *scan-only* "
              "calls only look for step ends. Budget: ReasonCache's 13.5 ms per step.", ""]
    rows = []
    for r in data["results"]:
        end = r["filter_ms_per_step_end"]
        rows.append([r["preset"], r["steps_decided"], f"{r['shared_blocks']}/{r['shareable_blocks']}",
                     f"{r['share_rate']:.3f}", f"{100 * r['memory_saving_ratio']:.1f}", f"{end['mean']:.1f}",
                     f"{end['p95']:.1f}", f"{r['steps_per_deciding_call']:.2f}", f"{r['filter_ms_per_decided_step']:.2f}",
                     f"{r['filter_ms_scan_only']['mean']:.2f}", f"{r['share_ms_per_call']:.2f}"])
    lines += _table(["preset", "steps decided", "shared / shareable blocks", "share rate", "memory saved %",
                     "step-end ms (mean)", "step-end ms (p95)", "steps per step-end call", "ms per decided step",
                     "scan-only ms", "share ms per layer call"], rows) + [""]


def kernel_label(name: str) -> str:
    """A short label for a CUDA kernel's signature: its name and the functors in its template."""
    name = re.sub(r"^(void )?std::enable_if<.*?>::type ", "", name.replace("(anonymous namespace)::", ""))
    cut = min([i for i in (name.find("<"), name.find("(")) if i >= 0], default=len(name))
    parts = name[:cut].replace("void ", "").strip().split("::")
    base = "::".join(parts[-2:]) if parts[-1] == "kernel" else parts[-1]  # gemvx::kernel, not kernel
    tags = []
    for tag in re.findall(r"(\w+(?:Functor|Ops)\w*|\w+_kernel_cuda|Cat\w+Copy)", name[cut:]):
        if tag not in tags and tag != base:
            tags.append(tag)
    rest = name[cut:]  # the data's dtype: a kernel on half types names float too (its accumulator)
    dtype = next((short for word, short in (("bfloat16", "bf16"), ("half", "fp16"), ("float", "fp32"))
                  if re.search(rf"(\b|_){word}\b", rest, re.IGNORECASE)), None)
    tags = tags[:2] + ([dtype] if dtype else [])
    return base + (f" [{', '.join(tags)}]" if tags else "")


def profile_groups() -> list[tuple[dict, list[dict]]]:
    """The profiles per setting (batch, prompt, GPU), the setting of the newest run first: each as
    its newest run and, per policy, the newest record at that setting, with its run's ``date`` (a
    run may profile some policies only; the page still shows the others as last measured)."""
    runs = [r for r in read_runs(RESULTS / "profile_decode_gpu.json") if not r.get("smoke")]
    groups: dict[tuple, tuple[dict, dict[str, dict]]] = {}
    for run in runs:
        for r in run["records"]:
            shape = (r["batch"], r["prompt"], run["environment"].get("gpu"))
            newest = groups.pop(shape, (run, {}))[1]  # re-inserted: the newest setting ends last
            newest[r["policy"]] = dict(r, date=run["environment"].get("date", ""))
            groups[shape] = (run, newest)
    return [(run, list(newest.values())) for run, newest in reversed(groups.values())]


def _plain_launches(record: dict) -> str:
    launches = record.get("launches_per_plain_step")
    return "–" if launches is None else f"{launches:.0f} ({record['launches_per_layer_plain_step']:.1f})"


def decode_profile(lines: list[str]) -> None:
    groups = profile_groups()
    if not groups:
        return
    lines += ["## Where a decode step goes", "",
              "`benchmarks/profile_decode.py`: GPU time per decode step by kernel (torch.profiler) over some decode "
              "steps (a run of that many more steps minus a short one), the static-shape path without CUDA graphs "
              "(the kernels a replayed graph runs), random Llama-3-8B-shaped weights in bf16, the decoder layers "
              "fused as `fast_generate` runs them on CUDA. `nvjet_*` and `splitKreduce` are cuBLAS GEMMs (the "
              "weights), `_paged_partial_kernel` and `packed_partial_kernel` (`nvfp4_partial_kernel` in earlier "
              "runs) the fused attention, `_merge_kernel` and `_rider_merge_kernel` the merge of its partial "
              "results, `triton_*` the decoder layers' fused norms, rotary, SiLU and residual sums, the "
              "`at::native` kernels the cache's bookkeeping and what runs outside the fused layers. One section "
              "per setting, the newest first.", ""]
    for data, recs in groups:
        _profile_setting(lines, data, recs)


def _profile_setting(lines: list[str], data: dict, recs: list[dict]) -> None:
    r0 = recs[0]
    dates = ", ".join(f"{r['policy']} {r['date'][:16]}" for r in recs)
    lines += [f"### Batch {r0['batch']}, prompt {r0['prompt']}", "",
              f"`profile_decode_gpu.json` — {_env(data)}; runs: {dates}; {r0['steps']} decode steps profiled.", ""]
    replayed = all(r.get("replay_ms_per_step") is not None for r in recs)
    launches = all(r.get("launches_per_layer") is not None for r in recs)
    plain = any(r.get("launches_per_plain_step") is not None for r in recs)
    totals = [[r["policy"], f"{r['ms_per_step']:.2f}"] + ([f"{r['replay_ms_per_step']:.2f}"] if replayed else [])
              + ([f"{r['launches_per_step']:.0f} ({r['launches_per_layer']:.1f})"] if launches else [])
              + ([_plain_launches(r)] if plain else []) for r in recs]
    lines += _table(["policy", "kernel ms per step"] + (["replayed step ms"] if replayed else [])
                    + (["kernel launches per step (per layer)"] if launches else [])
                    + (["launches per plain step (per layer)"] if plain else []), totals) + [""]
    if plain:
        lines += ["*Kernel launches per step* average every step's share of the periodic work (flushes of the "
                  "recent buffer, evictions, refreshes) into the step; *launches per plain step* count the host's "
                  "launch calls inside the steps that do none of it. A dash: not measured in that policy's run.", ""]
    names: list[str] = []
    for r in recs:
        names += [k["name"] for k in r["kernels"] if k["name"] not in names]
    us = [{k["name"]: k for k in r["kernels"]} for r in recs]

    def cell(table, name):
        k = table.get(name)
        return f"{k['us_per_step']:.0f} ({k['calls_per_step']:.0f})" if k else ""

    rows = [[f"`{kernel_label(name)}`"] + [cell(t, name) for t in us] for name in names]
    lines += _table(["kernel"] + [f"{r['policy']} µs (calls)" for r in recs], rows) + [""]
    mem = [[r["policy"]] + [f"{v:.2f}" for v in r["memory"].values()] for r in recs if r.get("memory")]
    if mem:
        keys = [k.replace("_gib", "") for k in next(r["memory"] for r in recs if r.get("memory"))]
        lines += ["Memory (GiB; *other* is decode peak above the weights less the KV allocation):", ""]
        lines += _table(["policy"] + keys, mem) + [""]


def render() -> dict[Path, str]:
    """Every generated file and its text."""
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/summarize.py` from `benchmarks/results/*.json`; do not edit by hand.",
             ""]
    figures: dict[Path, str] = {}
    e2e(lines, figures)
    for section in (tensor_parallel, attention, decode_profile, cpu_decode, quant, eviction, redundancy, thinkv,
                    thinkv_ops, sharing):
        section(lines)
    return {OUT: "\n".join(lines), **figures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page or its plot differ from the JSON")
    check = ap.parse_args(argv).check
    stale = []
    for path, text in render().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    for path in stale:
        print(f"{path} differs from benchmarks/results/*.json: run python benchmarks/summarize.py")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
