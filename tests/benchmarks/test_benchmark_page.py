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
