"""The printed report: one basis for every figure, nothing misleading for an empty cache,
and the samples in the docs are what the program prints (numbers masked)."""

import re
from pathlib import Path

import pytest

from conftest import char_tokenizer
from kvcompose import Policy, Report

ROOT = Path(__file__).resolve().parents[1]
REPORT_LABELS = ("memory basis ", "KV in use ", "evictions ", "avg bits ", "thought mix ")


def mask(line: str) -> str:
    """A report line with its numbers (and the docs' elisions) as ``…`` and runs of spaces as one."""
    line = re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "…", line.replace("...", "…"))
    return re.sub(r" +", " ", line).strip()


def doc_samples() -> list[tuple[str, list[str]]]:
    """Every ```text block in README.md and docs/ that shows report lines."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"```text\n(.*?)```", text, re.S):
            lines = block.rstrip("\n").splitlines()
            if any(line.startswith(REPORT_LABELS) for line in lines):
                out.append((str(path.relative_to(ROOT)), lines))
    return out


@pytest.fixture(scope="module")
def printed(llama) -> list[list[str]]:
    """What the program prints: an evicting CPU run, and a run with thought classes."""
    tok = char_tokenizer()
    window = Policy.from_preset("streamingllm", budget=16).generate(llama, tok, ["hello there " * 3],
                                                                    max_new_tokens=30, chat=False)
    thinkv = Policy.from_preset("thinkv", budget=48, refresh=8, classifier={"layers": [0, 1]}).generate(
        llama, tok, ["hello there " * 3], max_new_tokens=30, chat=False)
    return [str(window.report).splitlines(), str(thinkv.report).splitlines()]


@pytest.fixture(scope="module")
def llama():
    from conftest import tiny_model

    return tiny_model("llama")


def test_the_docs_show_report_samples():
    assert {path for path, _ in doc_samples()} >= {"docs/getting-started.md", "docs/thinkv.md"}


@pytest.mark.parametrize("path, lines", doc_samples())
def test_a_docs_sample_is_what_the_program_prints(path, lines, printed):
    sample = [mask(line) for line in lines]
    runs = [[mask(line) for line in run] for run in printed]
    if sample[0].startswith("memory basis"):  # a whole report: every line, in order
        assert sample in runs, \
            f"{path}: the sample is not a printed report\n" + "\n".join(sample) + "\n---\n" + "\n".join(runs[0])
    else:  # a part of one: consecutive printed lines
        found = any(run[i: i + len(sample)] == sample for run in runs for i in range(len(run)))
        assert found, f"{path}: these lines are not printed together:\n" + "\n".join(sample)


def test_one_basis_for_every_figure(printed, llama):
    text = "\n".join(printed[0])
    assert "held here" not in text and "float32" not in text.split("\n", 1)[1]
    out = Policy.from_preset("fullkv").generate(llama, char_tokenizer(), ["hello there " * 3], max_new_tokens=30,
                                                chat=False)
    assert out.report.avg_bits == 16.0  # float32 blocks at bf16 width, as a bf16 run holds them
    held = Policy.from_preset("fullkv").generate(llama, char_tokenizer(), ["hello there " * 3], max_new_tokens=30,
                                                 chat=False, memory_basis="model")
    assert held.report.avg_bits == 32.0 and "(float32 basis)" in str(held.report)


def test_an_empty_cache_reports_no_figures(llama):
    text = str(Policy.from_preset("fullkv").make_cache(llama).report())
    assert text == ("memory basis   a full bfloat16 cache of the same tokens\n"
                    "KV in use      nothing: the cache has seen no tokens yet")


def test_tokens_only_in_the_buffer_report_no_bits_and_say_why_memory_is_above_full(llama):
    out = Policy.from_preset("kivi2").generate(llama, char_tokenizer(), ["hello"], max_new_tokens=3, chat=False)
    report = out.report
    assert report.avg_bits is None and report.memory_fraction > 1
    text = str(report)
    assert "avg bits       none yet: every kept token still waits in the recent buffer" in text
    assert re.search(r"% of full: unfilled slots and metadata on top of \d+ tokens\)", text)
    assert "0.00 per value" not in text


def test_report_dict_round_trips_to_json(llama):
    import json

    report = Report.from_cache(Policy.from_preset("fullkv").make_cache(llama))
    assert json.loads(json.dumps(report.to_dict()))["avg_bits"] is None
