"""The docs' benchmark page and plot are generated from the recorded JSON and must match it."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


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
