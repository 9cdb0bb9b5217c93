"""The floor every speed record carries (kvcompose.speed): bytes a decode step reads over the
copy bandwidth, with the one copy reference the benchmarks and ``kvcompose bench`` share."""

from pathlib import Path

import pytest
import torch

from kvcompose import speed

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def test_weight_bytes_leave_out_an_untied_embedding_table_but_b_rows():
    model = _llama(tied=False)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = 96 * 64 * 2  # the input embedding, bf16
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    assert speed.weight_bytes_per_step(model, 1) == every - table + 64 * 2
    assert speed.weight_bytes_per_step(model, 16) == every - table + 16 * 64 * 2


def test_weight_bytes_count_a_table_tied_to_the_lm_head_once_and_in_full():
    model = _llama(tied=True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in model.parameters())  # the shared table once
    assert speed.weight_bytes_per_step(model, 16) == every
    untied = _llama(tied=False)
    assert every == sum(p.numel() * p.element_size() for p in untied.parameters()) - 96 * 64 * 2


def test_the_floor_is_the_bytes_read_over_the_copy_bandwidth():
    row = {"ms_per_step": 6.0, "weight_bytes_per_step": 16e9, "kv_bytes_read_per_step": 4e9}
    out = speed.add_floor(row, 4.0)  # 20 GB at 4 TB/s: 5 ms
    assert out["floor_ms_per_step"] == pytest.approx(5.0) and out["floor_ratio"] == pytest.approx(1.2)
    assert "floor_ms_per_step" not in row  # the record passed in is left as it was
    failed = {"error": "OutOfMemoryError"}
    assert speed.add_floor(failed, 4.0) == failed  # nothing measured, no floor


def test_ratio_to_fullkv_is_against_the_fullkv_row_and_absent_without_one():
    rows = [{"policy": "transformers-static", "tok_per_s": 250.0}, {"policy": "fullkv", "tok_per_s": 1000.0},
            {"policy": "rkv", "tok_per_s": 1500.0}, {"policy": "thinkv", "error": "failed"}]
    speed.add_fullkv_ratios(rows)
    assert [r.get("ratio_to_fullkv") for r in rows] == [0.25, 1.0, 1.5, None]
    without = [{"preset": "transformers-static", "tok_per_s": 250.0}, {"preset": "rkv", "tok_per_s": 1500.0}]
    speed.add_fullkv_ratios(without, key="preset")
    assert all("ratio_to_fullkv" not in r for r in without)
    failed_fullkv = [{"policy": "fullkv", "error": "out of memory"}, {"policy": "rkv", "tok_per_s": 1.0}]
    speed.add_fullkv_ratios(failed_fullkv)
    assert all("ratio_to_fullkv" not in r for r in failed_fullkv)
    layouts = [{"policy": "fullkv@slot", "tok_per_s": 500.0}, {"policy": "nvfp4", "tok_per_s": 1000.0}]
    speed.add_fullkv_ratios(layouts)  # fullkv on a named layout when it is the only fullkv
    assert [r["ratio_to_fullkv"] for r in layouts] == [1.0, 2.0]
    both = layouts + [{"policy": "fullkv", "tok_per_s": 1000.0}]
    speed.add_fullkv_ratios(both)  # the plain one first
    assert [r["ratio_to_fullkv"] for r in both] == [0.5, 1.0, 1.0]


def test_the_copy_reference_counts_read_and_written_bytes_and_is_the_benchmarks_one(monkeypatch):
    times, moved = speed.copy_times_ms("cpu", nbytes=2**20, warmup=0, repeats=3)
    assert moved == 2 * 2**20 and len(times) == 10 and all(t > 0 for t in times)  # at least ten timed calls
    assert speed.copy_tbps("cpu", nbytes=2**20) > 0
    assert speed.COPY_BYTES >= 2**30  # large enough to leave every cache behind
    monkeypatch.syspath_prepend(str(BENCH))
    from harness import timing

    assert timing.copy_tbps is speed.copy_tbps and timing.copy_times_ms is speed.copy_times_ms
