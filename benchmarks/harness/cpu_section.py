"""The results page's section on decoding on the CPU (``cpu_bench_smollm2.json``, from ``kvcompose bench --json``)."""

from __future__ import annotations

from .results import RESULTS_DIR, latest_run
from .table import NONE, markdown_table


def cpu_decode(lines: list[str]) -> None:
    """The newest run's presets: decode ms per step, against fullkv and against the floor."""
    run = latest_run(RESULTS_DIR / "cpu_bench_smollm2.json")
    if not run:
        return
    env = run["environment"]
    lines += ["## Decoding on the CPU", "",
              f"`cpu_bench_smollm2.json` — {env.get('cpu')} · {env.get('torch_threads')} torch thread(s) · torch "
              f"{env['versions'].get('torch')}, transformers {env['versions'].get('transformers')} · {env['date']}", "",
              f"`kvcompose bench` on the embedded SmolLM2-135M in fp32: batch {run['batch']}, prompts of "
              f"{run['prompt']} tokens, {run['new_tokens']} new tokens, the presets through the static-shape path run "
              "eagerly (no CUDA graphs) with the torch reference of the paged attention, the baseline transformers' "
              "static cache uncompiled. *x fullkv* is ms per step over fullkv's: the packed formats' decode cost on "
              "the path `kvcompose compare` and the demo take.", ""]
    full = next((r["ms_per_step"] for r in run["runs"] if r["preset"] == "fullkv"), None)
    rows = [[r["preset"], f"{r['ms_per_step']:.1f}", f"{r['ms_per_step'] / full:.2f}" if full else NONE,
             f"{r['floor_ratio']:.1f}" if r.get("floor_ratio") else NONE] for r in run["runs"] if "ms_per_step" in r]
    lines += markdown_table(["preset", "ms/step", "x fullkv ms", "floor ratio"], rows) + [""]
