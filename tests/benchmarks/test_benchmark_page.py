"""The docs' benchmark page and plot are generated from the recorded JSON and must match it."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _summarize():
    spec = importlib.util.spec_from_file_location("summarize", BENCH / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_matches_the_json():
    assert _summarize().main(["--check"]) == 0


def test_check_names_a_stale_page(tmp_path, monkeypatch, capsys):
    summarize = _summarize()
    stale = tmp_path / "benchmark-results.md"
    stale.write_text("# edited by hand\n")
    pages = summarize.render()
    monkeypatch.setattr(summarize, "render", lambda: {stale: pages[summarize.OUT]})
    assert summarize.main(["--check"]) == 1
    assert str(stale) in capsys.readouterr().out


def test_the_end_to_end_table_shows_the_newest_record_of_each_policy_and_its_baseline():
    def rec(policy, scenario, run):
        return {"policy": policy, "scenario": scenario, "run": run}

    older = {"environment": {"runs": {"b4": {"gpu": "NVIDIA H100"}, "b5": "2026-11-01"}},
             "records": [rec("transformers-static", "b", "b4"), rec("rkv", "b", "b4"),
                         rec("transformers-static", "b", "b5"), rec("snapkv", "b", "b5")]}
    newer = {"environment": {"gpu": "NVIDIA H200"}, "records": [rec("transformers-static", "b", "b7"),
                                                                 rec("rkv", "b", "b7")]}
    summarize = _summarize()
    shown = summarize.shown_e2e_records([older, newer])
    got = [(r["policy"], r["run"], summarize._run_gpu(env)) for r, env in shown]
    # rkv's newest record is b7's, so b4's baseline goes with its older record; b5's stays for snapkv
    assert got == [("transformers-static", "b5", "not recorded"), ("snapkv", "b5", "not recorded"),
                   ("transformers-static", "b7", "H200"), ("rkv", "b7", "H200")]


def test_the_page_describes_the_scenarios_the_benchmark_runs(monkeypatch):
    import os
    import sys

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))  # restored after
    sys.modules.pop("bench_e2e_gpu", None)
    import bench_e2e_gpu

    assert _summarize().E2E_SCENARIOS == bench_e2e_gpu.SCENARIOS


def test_end_to_end_tables_show_the_new_fields_and_a_dash_where_an_old_record_lacks_them():
    summarize = _summarize()
    old = {"environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "notes": "a long history of earlier runs " * 100,
           "records": [{"policy": "transformers-static", "scenario": "b", "run": "b4", "batch": 16, "new_tokens": 256,
                        "ms_per_step": 64.5, "tok_per_s": 248.0, "ratio_to_baseline": 1.0, "peak_gib": 32.9},
                       {"policy": "rkv", "scenario": "b", "run": "b4", "batch": 16, "new_tokens": 8192,
                        "ms_per_step": 14.6, "tok_per_s": 1092.0, "ratio_to_baseline": 4.41, "peak_gib": 25.5}]}
    new = {"environment": {"gpu": "NVIDIA H200"}, "copy_tbps": 4.3, "records": [
        {"policy": "transformers-static", "scenario": "long", "run": "l1", "batch": 16, "new_tokens": 512,
         "timed_steps": 511, "ms_per_step": 40.0, "floor_ms_per_step": 8.0, "floor_ratio": 5.0, "tok_per_s": 400.0,
         "ratio_to_fullkv": 0.5, "ratio_to_baseline": 1.0, "peak_gib": 40.0},
        {"policy": "fullkv", "scenario": "long", "run": "l1", "batch": 16, "new_tokens": 512, "timed_steps": 511,
         "ms_per_step": 20.0, "steady_ms_per_step": 18.0, "floor_ms_per_step": 7.5, "floor_ratio": 2.67,
         "tok_per_s": 800.0, "ratio_to_fullkv": 1.0, "ratio_to_baseline": 2.0, "peak_gib": 39.0,
         "eviction_share": 0.0, "pool_layout": "head"}]}
    lines = []
    summarize.e2e(lines, {}, [old, new])
    page = "\n".join(lines)
    assert "a long history" not in page  # a run's notes stay in the JSON
    assert ("| rkv@slot | b4 | H100 80GB HBM3 | 16 | 8,192 | — | 14.6 | — | — | — | 1,092 | — | 4.41 | 25.5 | — |"
            in page)
    assert "| fullkv | l1 | H200 | 16 | 512 | 511 | 20.0 | 18.0 | 7.50 | 2.67 | 800 | 1.00 | 2.00 | 39.0 | 0.0 |" in page
    assert "| transformers-static | l1 | H200 | 16 | 512 | 511 | 40.0 | — | 8.00 | 5.00 | 400 | 0.50 | 1.00 | 40.0 | — |" in page
    assert "In run b4, recorded before both sides timed the same steps" in page
    assert page.count("No run recorded yet.") == 2  # scenarios a and c


def test_the_page_knows_the_policy_default_pool_layout():
    from kvcompose.policies.policy import DEFAULT_POOL_LAYOUT

    assert _summarize().DEFAULT_POOL_LAYOUT == DEFAULT_POOL_LAYOUT


def test_the_page_knows_the_attention_grids_launch_settings(monkeypatch):
    from kvcompose.ops.paged_attention import launch

    monkeypatch.syspath_prepend(str(BENCH))
    import bench_attention_gpu

    summarize = _summarize()
    assert (summarize.TOKENS_PER_SPLIT_MIN, summarize.SMALL_SOURCE_TOKENS, summarize.DEFAULT_BUFFER) == (
        launch.TOKENS_PER_SPLIT_MIN, launch.SMALL_SOURCE_TOKENS, bench_attention_gpu.BUFFER)


def test_records_are_named_by_the_pool_layout_they_ran_on():
    """Before ``pool_layout`` was recorded, a name without ``@layout`` ran on slot-major pools."""
    summarize = _summarize()
    names = ["transformers-static", "nvfp4", "nvfp4@head", "nvfp4+hadamard@head", "rkv@slot", "fullkv", "thinkv"]
    layouts = [None, None, None, None, None, "slot", "head"]
    records = [{"policy": n, **({"pool_layout": lay} if lay else {})} for n, lay in zip(names, layouts)]
    entry = {"environment": {}, "records": records}
    (labelled,) = summarize.layout_labelled([entry])
    assert [r["policy"] for r in labelled["records"]] == [
        "transformers-static", "nvfp4@slot", "nvfp4", "nvfp4+hadamard", "rkv@slot", "fullkv@slot", "thinkv"]
    assert [r["policy"] for r in records] == names  # what the file holds is left as recorded


def test_records_of_a_run_without_the_cuda_attention_kernel_say_so():
    summarize = _summarize()
    records = [{"policy": "transformers-static"}, {"policy": "thinkv-int", "pool_layout": "head"},
               {"policy": "nvfp4", "pool_layout": "slot"}]
    off = {"attention_kernels": "Triton; NVFP4, ternary, INT4 and INT2 pools: Triton (KVCOMPOSE_NATIVE_ATTENTION=0)",
           "records": records}
    on = {"attention_kernels": "Triton; NVFP4, ternary, INT4 and INT2 pools: CUDA (native_packed.cu built for sm_90)",
          "records": records}
    unbuilt = {"attention_kernels": "Triton; NVFP4 and ternary pools: Triton (nvcc not found (set CUDA_HOME to "
                                    "build the CUDA kernel))", "records": records}
    labelled_off, labelled_on, labelled_unbuilt = summarize.layout_labelled([off, on, unbuilt])
    assert [r["policy"] for r in labelled_off["records"]] == [
        "transformers-static", "thinkv-int/triton", "nvfp4@slot/triton"]
    assert [r["policy"] for r in labelled_on["records"]] == ["transformers-static", "thinkv-int", "nvfp4@slot"]
    assert [r["policy"] for r in labelled_unbuilt["records"]] == [r["policy"] for r in labelled_off["records"]]


def test_the_attention_section_sets_the_newest_grid_of_each_pool_layout_side_by_side():
    summarize = _summarize()

    def run(layout, ms, **extra):
        rows = [{"format": f, "kernel": "triton", "batch": 16, "tokens": 8192, "head_dim": 128, "ms": ms[f],
                 "fraction_of_copy": 0.1 / ms[f]} for f in ms]
        return {"environment": {"gpu": "NVIDIA H200"}, "copy_tb_per_s": 4.28, "results": rows, **extra, **layout}

    runs = [run({}, {"bf16": 0.2, "nvfp4": 0.12}), run({"layout": "head"}, {"bf16": 0.2, "nvfp4": 0.1}),
            run({"layout": "head"}, {"bf16": 0.2, "nvfp4": 0.05}, smoke=True),
            run({"layout": "head"}, {"bf16": 0.2})]
    assert summarize.full_attention_grid(runs, "slot") is runs[0]
    # a smoke run is not a grid, nor is a run of fewer formats than the grid before it
    assert summarize.full_attention_grid(runs, "head") is runs[1]
    # newer runs say whether --formats narrowed them: that decides, whatever the formats before
    whole = run({"layout": "head"}, {"bf16": 0.2}, narrowed=False)
    assert summarize.full_attention_grid(runs + [whole], "head") is whole
    assert summarize.full_attention_grid(runs + [whole, run({"layout": "head"}, {"bf16": 0.3}, narrowed=True)],
                                         "head") is whole
    lines = []
    summarize.attention_layouts(lines, runs)
    assert "| nvfp4 | triton | 16x8192x128 | 120 | 100 | 83 | 100 | 1.20 |" in lines
    assert "| bf16 | triton | 16x8192x128 | 200 | 200 | 50 | 50 | 1.00 |" in lines
    lines = []
    summarize.attention_layouts(lines, runs[:1])  # one layout only: nothing to set beside it
    assert lines == []


def test_runs_of_a_few_formats_after_the_grid_are_shown_beside_its_figures():
    summarize = _summarize()

    def run(ms, **extra):
        rows = [{"format": f, "kernel": "cuda", "batch": 16, "tokens": 8192, "head_dim": 128, "ms": ms[f],
                 "fraction_of_copy": 0.1 / ms[f]} for f in ms]
        return {"environment": {"gpu": "NVIDIA H200", "date": "d"}, "copy_tb_per_s": 4.28, "results": rows,
                "layout": "head", "formats": list(ms), **extra}

    older = run({"int2": 0.25}, narrowed=True)
    grid = run({"bf16": 0.2, "int2": 0.2, "nvfp4": 0.1}, narrowed=False)
    smoke = run({"int2": 0.01}, narrowed=True, smoke=True)
    other_layout = run({"int2": 0.01}, narrowed=True, layout="slot")
    # a longer recent buffer or shorter splits answer another question: neither a grid nor beside it
    long_buffer = run({"bf16": 0.2, "int2": 0.2, "nvfp4": 0.1}, narrowed=False, shapes={"buffer_tokens": 160})
    short_splits = run({"bf16": 0.2, "int2": 0.2, "nvfp4": 0.1}, narrowed=False, tokens_per_split_min=32)
    newer = run({"bf16": 0.2, "int2": 0.16, "int8": 0.3}, narrowed=True, tokens_per_split_min=256)
    runs = [older, grid, smoke, other_layout, long_buffer, short_splits, newer]
    assert summarize.full_attention_grid(runs) is grid
    assert summarize.runs_since_grid(runs, grid) == [newer]
    lines = []
    summarize.attention_since_grid(lines, runs, grid)
    assert "### A run of bf16, int2, int8 since the grid" in lines
    assert "| int2 | cuda | 16x8192x128 | 160 | 62 | 50 | 1.25 |" in lines
    assert "| int8 | cuda | 16x8192x128 | 300 | 33 | — | — |" in lines  # not in the grid
    lines = []
    summarize.attention_since_grid(lines, runs[:2], grid)
    assert lines == []


def long_record(policy: str, run: str, **fields) -> dict:
    """A scenario-long record of batch 16 with ``fields`` added."""
    return {"policy": policy, "scenario": "long", "run": run, "batch": 16, "new_tokens": 512, "ms_per_step": 10.0,
            "tok_per_s": 1600.0, **fields}


def test_runs_timed_before_the_warm_up_at_their_capacity_are_named_with_their_one_time_work():
    summarize = _summarize()

    rec = long_record
    records = [rec("transformers-static", "l1"), rec("fullkv", "l1", one_time_s=1.27),
               rec("rkv", "l1", one_time_s=3.99), rec("fullkv", "l0"),  # before one-time work was recorded
               rec("transformers-static", "l2"), rec("fullkv", "l2", one_time_s=0.15, warm_up_s=32.8)]
    assert summarize._cold_runs(records) == ["l1"]
    lines = []
    summarize.e2e(lines, {}, [{"environment": {"gpu": "NVIDIA H200"}, "records": records}])
    page = "\n".join(lines)
    assert "In run l1, recorded before the warm-up ran at the timed run's capacity" in page
    assert "(4.0 s of one-time work per preset in these records" in page  # l1's rkv: fullkv's newest is l2's


def test_the_readme_speed_figures_are_the_jsons():
    """The README's end-to-end claims, recomputed from the records the results page shows."""
    import re

    from kvcompose.policies import presets

    summarize = _summarize()
    runs = summarize.layout_labelled([r for r in summarize.read_runs(summarize.RESULTS / "e2e_gpu.json")
                                      if not r.get("smoke")])
    shown = summarize.shown_e2e_records(runs)
    readme = re.sub(r"\s+", " ", (BENCH.parent / "README.md").read_text())

    def newest(scenario):
        """The shown records of ``scenario`` by preset: a preset's record on today's default pool
        layout, else its record on slot-major pools (its label says which)."""
        shown_here = {r["policy"]: (r, env) for r, env in shown if r["scenario"] == scenario}
        return {p: shown_here.get(p) or shown_here[p + "@slot"] for p in {k.partition("@")[0] for k in shown_here}
                if p in shown_here or p + "@slot" in shown_here}

    def latest_run(scenario):
        """The records of the newest run of ``scenario`` that compares fullkv with another preset, every
        pool read by the default kernels (a ``/triton`` run is a diagnosis, not a comparison), baseline
        left out."""
        by_run = {}
        for entry in runs:
            for r in entry["records"]:
                if r["scenario"] == scenario and r["policy"] != summarize.BASELINE:
                    by_run.setdefault(r["run"], {})[r["policy"]] = r
        compared = [run for run in by_run.values() if len(run) > 1 and any(p.startswith("fullkv") for p in run)
                    and not any(p.endswith("/triton") for p in run)]
        return compared[-1]

    def span(values, digits=1):
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return f"{low}x" if low == high else f"{low}-{high}x"

    def named(run):
        """The policies of a run as the README lists them, each by its label on the results page:
        "fullkv, fp8 and nvfp4", "fullkv@slot, nvfp4 and nvfp4@slot"."""
        order = ["fullkv", "fp8", "nvfp4", "kivi2", "rkv", "snapkv", "thinkv", "thinkv-int"]
        presets = {p.partition("@")[0] for p in run}
        assert presets <= set(order) and "fullkv" in presets, f"README names only {order}; the run has {sorted(run)}"
        names = sorted(run, key=lambda p: (order.index(p.partition("@")[0]), p))
        return ", ".join(names[:-1]) + " and " + names[-1]

    a, long = latest_run("a"), latest_run("long")
    assert (f"{named(a)} run {span([r['ratio_to_baseline'] for r in a.values()])} the tokens/s of transformers' "
            "compiled static cache with 512-token prompts and 2,048 new tokens, and "
            f"{named(long)} {span([r['ratio_to_baseline'] for r in long.values()])} with 8,192-token prompts") in readme

    def to_fullkv(run):
        return span([r["ratio_to_fullkv"] for p, r in run.items() if p.partition("@")[0] != "fullkv"], 2)

    assert (f"decode at {to_fullkv(a)} its tokens/s (2,048 new tokens) and {to_fullkv(long)} (8,192-token "
            "prompts)") in readme
    b = newest("b")
    assert (f"{b['nvfp4'][0]['policy']} and {b['fp8'][0]['policy']} {b['nvfp4'][0]['ratio_to_baseline']:.1f}x and "
            f"{b['fp8'][0]['ratio_to_baseline']:.1f}x") in readme
    assert {summarize._run_gpu(b[p][1]) for p in ("nvfp4", "fp8")} == {"H200"}
    c = newest("c")
    thinkv, env = c["thinkv"]
    base = next(r for r, _ in shown if r["policy"] == summarize.BASELINE and r["run"] == thinkv["run"])
    windows = (f"both timed over their first {base['new_tokens']:,} new tokens"
               if thinkv["new_tokens"] == base["new_tokens"] else
               f"ThinKV timed over its first {thinkv['new_tokens']:,} new tokens, the baseline over {base['new_tokens']:,}")
    assert (f"{thinkv['policy']} fits {thinkv['batch']} rows to the baseline's {base['batch']} and decodes "
            f"{thinkv['ratio_to_baseline']:.1f}x its tokens/s ({summarize._run_gpu(env)}; {windows}") in readme
    full, _ = c["fullkv"]  # a run cut short before its fullkv is named, with its own ThinKV figure
    said = f"{full['policy']} fits {full['batch']} rows and decodes {full['ratio_to_baseline']:.1f}x"
    if full["run"] == thinkv["run"]:
        said += f", so ThinKV gives {thinkv['ratio_to_fullkv']:.2f}x fullkv's tokens/s"
    else:
        def in_run(policy, run):
            return next((r for entry in runs for r in entry["records"] if r["policy"] == policy and r["run"] == run),
                        None)

        same_run = in_run(thinkv["policy"], full["run"])
        if same_run is not None:
            said += f" in run {full['run']}, with ThinKV at {same_run['ratio_to_baseline']:.1f}x"
        else:  # the newest fullkv's run ended before ThinKV's turn: the newest run with both is named too
            both = [r for entry in runs for r in entry["records"] if r["policy"] == full["policy"]
                    and r.get("scenario") == "c" and in_run(thinkv["policy"], r["run"]) is not None][-1]
            said += (f" in run {full['run']}, which ended before ThinKV's turn; {both['ratio_to_baseline']:.1f}x in run "
                     f"{both['run']}, with ThinKV at {in_run(thinkv['policy'], both['run'])['ratio_to_baseline']:.1f}x")
    assert said in readme
    assert "grows with" not in readme  # the baseline's step spans its whole reserved cache at every step


def test_the_rotation_cost_on_its_api_page_comes_from_its_run():
    import json

    runs = {r["run"]: r for r in json.loads((BENCH / "results" / "rotation_e2e_gpu.json").read_text())["runs"]}
    steady = {r["policy"]: r["steady_ms_per_step"] for r in runs["rot3"]["records"] if r.get("steady_ms_per_step")}
    page = " ".join((BENCH.parent / "docs" / "api" / "rotations.md").read_text().split())
    for plain in ("fullkv", "nvfp4"):
        assert f"from {steady[plain]:.2f} to {steady[plain + '+hadamard']:.2f} ms for {plain}" in page
    assert runs["rot3"]["environment"]["gpu"] == "NVIDIA H200" and "H200" in page
    folded = {r["policy"]: r for r in runs["rot6"]["records"]}  # the value rotation in the weights
    for plain in ("fullkv", "nvfp4"):
        before, after = folded[plain]["steady_ms_per_step"], folded[plain + "+hadamard"]["steady_ms_per_step"]
        assert after > before and folded[plain + "+hadamard"]["rotation_in_weights"] == 32
        assert f"from {before:.2f} to {after:.2f} ms" in page and f"(+{100 * (after / before - 1):.1f}%)" in page
    assert f"from {folded['fullkv']['peak_gib']:.2f} to {folded['fullkv+hadamard']['peak_gib']:.2f} GiB" in page


def test_runs_timed_on_their_profiled_run_are_named():
    """A run whose presets were timed with the device drained before every step says so."""
    summarize = _summarize()

    rec = long_record
    records = [rec("transformers-static", "l1"), rec("rkv", "l1", steady_ms_per_step=9.0),
               rec("transformers-static", "l2"), rec("fullkv", "l2", steady_ms_per_step=9.0, profiled_ms_per_step=10.5),
               rec("snapkv", "l0")]  # before steps were profiled at all
    assert summarize._synced_runs(records) == ["l1"]
    lines = []
    summarize.e2e(lines, {}, [{"environment": {"gpu": "NVIDIA H200"}, "records": records}])
    assert "In run l1, kvcompose's *ms/step* comes from the profiled run" in "\n".join(lines)


def test_the_profile_section_keeps_every_setting_with_each_policys_newest_record(monkeypatch):
    def run(date, gpu, *records):
        return {"environment": {"date": date, "gpu": gpu},
                "records": [{"policy": p, "batch": b, "prompt": 512, "ms": ms} for p, b, ms in records]}

    runs = [run("2026-01-01", "H100", ("fullkv", 16, 1.0), ("rkv", 16, 2.0)),
            run("2026-01-02", "H200", ("thinkv", 447, 3.0)),
            run("2026-01-03", "H100", ("rkv", 16, 4.0)),  # a newer rkv at the first setting
            run("2026-01-04", "H200", ("thinkv", 447, 5.0))]
    summarize = _summarize()
    monkeypatch.setattr(summarize, "read_runs", lambda path: runs)
    groups = summarize.profile_groups()
    assert [(g[0]["environment"]["date"], [(r["policy"], r["ms"]) for r in g[1]]) for g in groups] == [
        ("2026-01-04", [("thinkv", 5.0)]), ("2026-01-03", [("fullkv", 1.0), ("rkv", 4.0)])]
